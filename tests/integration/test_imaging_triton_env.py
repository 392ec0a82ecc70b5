"""The Triton-side `imaging` module in the Triton environment itself (its own Python, numpy<2, no transformers),
against transformers' image processor: a process of that environment, so here and not in the unit tier."""

import json
import subprocess
from pathlib import Path

import numpy as np

from core.envs import TRITON, env_under
from export.vision import read_image_processor, reference_pixels
from tests.unit.test_imaging import ATOL, IMAGING_DIR, _checkpoint, _max_diff, images  # noqa: F401 (images: a fixture)

TRITON_PYTHON = env_under(Path(__file__).resolve().parents[2], TRITON) / "bin" / "python"


def test_imaging_runs_in_the_triton_environment_without_transformers(tmp_path, images):
    folder = _checkpoint(tmp_path, "convnext-224")
    settings_path = tmp_path / "settings.json"
    settings_path.write_text(json.dumps(read_image_processor(folder)))
    np.savez(tmp_path / "images.npz", *[np.frombuffer(data, dtype=np.uint8) for data in images])
    script = (
        "import json, sys; import numpy as np\n"
        f"sys.path.insert(0, {str(IMAGING_DIR)!r})\n"
        "import imaging\n"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'imaging pulled in ML libraries'\n"
        f"pre = imaging.Preprocess(json.load(open({str(settings_path)!r})))\n"
        f"images = np.load({str(tmp_path / 'images.npz')!r})\n"
        "out = np.stack([pre(images[f'arr_{i}'].tobytes()) for i in range(len(images.files))])\n"
        f"np.save({str(tmp_path / 'out.npy')!r}, out)\n"
        "print(np.__version__)\n"
    )
    run = subprocess.run([str(TRITON_PYTHON), "-I", "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith("1."), "the Triton environment must keep numpy<2"
    assert _max_diff(np.load(tmp_path / "out.npy"), np.stack(reference_pixels(folder, images))) <= ATOL
