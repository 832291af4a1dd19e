"""Model directories this package writes are meant to be mounted into an engine that runs as another uid.

transformers writes weight shards through a private temporary file (mode 0600) and `tempfile.mkdtemp` makes
0700 directories: through a volume, the engine (uid 1000 in the images) could list the directory but not
read the weights, and reported a file that exists as missing. Everything these builders write ends world-
readable, as `cp` under the usual umask would leave it: 0644 files, 0755 directories.
"""
from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o644
DIR_MODE = 0o755


def share_readable(root: str | Path) -> Path:
    """chmod `root` and everything under it (symlinks are left alone); returns `root` as a Path."""
    root = Path(root)
    if not root.is_symlink():
        os.chmod(root, DIR_MODE if root.is_dir() else FILE_MODE)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, DIR_MODE if name in dirs else FILE_MODE)
    return root
