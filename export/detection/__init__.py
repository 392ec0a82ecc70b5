"""Object detection: what the DETR family adds to the encoder pipeline and the check of the served answers against
the framework's own predict (detr.py), and Ultralytics YOLO runs exported in Ultralytics' own environment (yolo.py,
which starts ultralytics_runner.py there).
"""
