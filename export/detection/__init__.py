"""Object detection: what the DETR family adds to the encoder pipeline (detr.py), Ultralytics YOLO runs exported in
Ultralytics' own environment (yolo.py, which starts ultralytics_runner.py there), and the check both go through: the
served steps' answers against the framework's own predict (served.py).
"""
