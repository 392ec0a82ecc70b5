"""`/v1/detect`: object detection (DETR, YOLO) by a Triton entry, boxes in the image's own pixels."""
