"""Deep Lake 4.7.4 segfaults now and then when a read fails: a 30-line reproducer.

Makes a small JPEG dataset, deletes its image chunk, then reads 50 rows in this process and catches each
error. Run it in fresh processes and count the deaths:

    for i in $(seq 20); do python docs/deeplake_failing_read.py /tmp/broken; echo "rc=$?"; done | sort | uniq -c

rc=0 means every read raised and was caught; rc=-11 / 139 is the segfault (Deep Lake's MainQueueThread
rethrows an empty std::exception_ptr while delivering the failed read's result).
"""

import pathlib
import shutil
import sys

import deeplake
import numpy as np

path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/deeplake-broken")
shutil.rmtree(path, ignore_errors=True)
ds = deeplake.create(f"file://{path}")
ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
rng = np.random.default_rng(0)
ds.append({"images": rng.integers(0, 255, (64, 32, 32, 3), dtype=np.uint8)})
ds.commit()
del ds
chunk = max((p for p in path.rglob("*") if p.is_file() and "_deeplake_log" not in p.parts), key=lambda p: p.stat().st_size)
chunk.unlink()  # the largest chunk file holds the images

ds = deeplake.open_read_only(f"file://{path}")
failed = 0
for i in range(50):
    try:
        ds["images"][i]
    except Exception:  # noqa: BLE001 - each failing read should be an ordinary exception
        failed += 1
print(f"{failed} of 50 reads raised; process alive")
