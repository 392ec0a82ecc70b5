"""What a server leaves behind when it fails: the root cause in the error we show, and no shared memory held after it
was killed."""

import mmap
import os
import time

from serve.launcher import log_tail
from serve.triton_server import SHM_REGION_PREFIX, remove_orphaned_regions


def test_the_tail_of_a_log_leads_with_the_exception_raised_earlier_in_it(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("\n".join([
        "(EngineCore pid=7) INFO starting",
        "(EngineCore pid=7) ValueError: Available memory on node 0 (0.5/23.5 GiB) is less than requested",
        "(EngineCore pid=7) ValueError: Available memory on node 0 (0.5/23.5 GiB) is less than requested",
        *[f"(APIServer pid=6) traceback line {i}" for i in range(50)],
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]))
    lines = log_tail(log).splitlines()
    assert lines[:3] == ["exceptions earlier in the log:",
                         "(EngineCore pid=7) ValueError: Available memory on node 0 (0.5/23.5 GiB) is less than requested",
                         "..."]  # once, however often it was logged
    assert lines[3:] == [*[f"(APIServer pid=6) traceback line {i}" for i in range(11, 50)],
                         "RuntimeError: Engine core initialization failed. See root cause above."]
    short = tmp_path / "short.log"
    short.write_text("ready\n")
    assert log_tail(short) == "ready" and log_tail(tmp_path / "none.log") == "(no log)"


def test_only_the_regions_no_process_maps_any_more_are_removed(tmp_path):
    def region(name: str, age_s: float):
        path = tmp_path / f"{SHM_REGION_PREFIX}{name}"
        path.write_bytes(b"\0" * mmap.PAGESIZE)
        os.utime(path, (time.time() - age_s,) * 2)
        return path

    orphan, mapped, young = region("orphan", 600), region("mapped", 600), region("young", 1)
    other = tmp_path / "psm_not_triton"
    other.write_bytes(b"x")
    os.utime(other, (time.time() - 600,) * 2)
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 0):  # a live server's stub maps its region
        assert remove_orphaned_regions(tmp_path) == [orphan]
    assert not orphan.exists() and mapped.exists() and young.exists() and other.exists()
    assert remove_orphaned_regions(tmp_path) == [mapped]  # once nothing maps it

