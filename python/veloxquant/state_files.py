"""A saved ``VeloxQuantCache`` state (a prompt-cache file, say): its
checksums, and where mlx_lm's prompt-cache functions are reading or writing
it (for the checksums and for error messages)."""

import json
import sys
import zlib
from typing import Any, Dict, Mapping

import mlx.core as mx

# The entries of VeloxQuantCache.state.
STATE_KEYS = ("config", "layout", "arrays", "crc32")


class CorruptStateError(ValueError):
    """A VeloxQuantCache state (a prompt-cache file, say) whose contents do not
    match the checksums saved with it."""


def array_crc32(name: str, a: mx.array) -> str:
    """CRC-32 of an array's name, dtype and shape, then its bytes (row-major,
    as safetensors holds them)."""
    crc = zlib.crc32(f"{name} {a.dtype} {list(a.shape)}".encode())
    if a.size:
        crc = zlib.crc32(memoryview(mx.contiguous(a).view(mx.uint8)), crc)
    return f"{crc:08x}"


def state_checksums(state: Mapping[str, Any]) -> Dict[str, str]:
    sums = {k: f"{zlib.crc32(state[k].encode()):08x}" for k in ("config", "layout") if isinstance(state.get(k), str)}
    arrays = state.get("arrays", {})
    if isinstance(arrays, Mapping):
        mx.eval(list(arrays.values()))
        for name, a in arrays.items():
            sums[f"arrays.{name}"] = array_crc32(str(name), a) if isinstance(a, mx.array) else "not an array"
    return sums


def check_state_checksums(state: Mapping[str, Any]) -> None:
    """Raise CorruptStateError unless every entry of ``state`` matches its
    checksum in ``state["crc32"]`` and every checksum has its entry."""

    def corrupt(what: str):
        return CorruptStateError(
            f"VeloxQuantCache.state{file_note()}: {what}: the state is corrupt (changed after it was saved, "
            "or cut short); save it again"
        )

    try:
        want = json.loads(state["crc32"]) if isinstance(state["crc32"], str) else None
    except ValueError:
        want = None
    if not isinstance(want, dict) or not all(isinstance(x, str) for x in want.values()):
        raise corrupt("its 'crc32' entry is not the JSON object of checksums veloxquant writes")
    got = state_checksums(state)
    for key in sorted(set(want) | set(got)):
        if key not in got:
            raise corrupt(f"'{key}' has a checksum but is missing")
        if key not in want:
            raise corrupt(f"'{key}' has no checksum")
        if got[key] != want[key]:
            raise corrupt(f"'{key}' does not match its CRC-32 ({got[key]}, saved {want[key]})")


def called_from_save_prompt_cache() -> bool:
    """Whether mlx_lm's ``save_prompt_cache`` is reading ``state`` (through its
    list comprehension, a frame of its own before Python 3.12)."""
    try:
        f = sys._getframe(2)
    except ValueError:  # read from native code with no Python caller
        return False
    for _ in range(3):
        if f is None:
            return False
        if f.f_code.co_name == "save_prompt_cache" and f.f_globals.get("__name__", "").startswith("mlx_lm."):
            return True
        f = f.f_back
    return False


def file_note() -> str:
    """' (file NAME)' when mlx_lm's ``load_prompt_cache`` is loading the state
    (for error messages), else ''."""
    f = sys._getframe(1)
    for _ in range(8):
        if f is None:
            break
        if f.f_code.co_name == "load_prompt_cache" and f.f_globals.get("__name__", "").startswith("mlx_lm."):
            name = f.f_locals.get("file_name")
            return f" (file {name})" if isinstance(name, (str, bytes)) or hasattr(name, "__fspath__") else ""
        f = f.f_back
    return ""
