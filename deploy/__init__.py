"""From a deployment file to a running box: the file (spec), the memory planner (estimates, plan, measure), the
servers it runs (services), the box on this machine (`serve up / status / down`: box, keeper), the targets rendered
(render: compose, systemd, Kubernetes; images; monitoring), TensorRT engines built on the box, the air-gapped bundle
and `rtxserve doctor`."""
