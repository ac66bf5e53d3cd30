"""Reading JSON and YAML that anyone may have written: bounded in size, depth and number width, no surprises.

Every file offload-plan reads (safetensors headers, the index, config.json, plans, profiles) goes through
here, so a hostile or broken file costs milliseconds and ends in one line naming the file:

- a size cap per kind of file, checked before reading;
- nesting deeper than MAX_DEPTH levels is refused (Python's parsers would recurse until RecursionError);
- integers longer than MAX_INT_DIGITS digits are refused (int() of a 5,000-digit string raises ValueError);
- duplicate keys are refused: JSON and YAML parsers silently keep the last one, so two tools reading the same
  file could disagree about it;
- YAML aliases (``*name``) are refused: a dozen nested aliases expand to billions of nodes (an "alias bomb"),
  and plans and profiles are plain data that never need them;
- JSON's NaN and Infinity words are refused unless the caller accepts them (config.json may hold them in
  keys the planner never reads; the keys it reads are checked one by one).
"""

import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

import yaml
import yaml.composer
import yaml.constructor
import yaml.resolver

from planner.errors import OffloadPlanError, printable, shown

#: deeper than any file offload-plan reads (headers: 3, configs: 4-5, plans: 3)
MAX_DEPTH = 32
#: 2**64 has 20 digits; anything much longer is not a count or an offset
MAX_INT_DIGITS = 30


class _Refused(ValueError):
    """A reason to refuse the document, turned into the caller's error class with its origin."""


#: the longest path and path component Linux accepts (PATH_MAX, NAME_MAX); longer ones fail with ENAMETOOLONG
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255


def checked_path(path: Path | str, error_class: type[OffloadPlanError], what: str) -> Path:
    """``path`` if the file system could hold it, else one line: a name longer than the file system allows
    (ENAMETOOLONG) makes every later exists(), is_dir() and open() raise, at whichever call meets it first."""
    text = os.fsencode(str(path))
    longest = max((len(part) for part in text.split(b"/")), default=0)
    if len(text) >= MAX_PATH_BYTES or longest > MAX_NAME_BYTES:
        raise error_class(f"{what} {shown(str(path))} is longer than the file system allows (a name of at most "
                          f"{MAX_NAME_BYTES} bytes, a path under {MAX_PATH_BYTES}); check the path")
    return Path(path)


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device file" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"


def open_regular(path: Path, error_class: type[OffloadPlanError], what: str) -> tuple[BinaryIO, int]:
    """``path`` opened for reading, with its size, only if it is a regular file; anything else is one line.

    The one way offload-plan opens an input. The open itself is non-blocking, so a FIFO (whose open waits for a
    writer, forever) or a device is seen by fstat on the descriptor, before any read, and refused: reads of a
    regular file end, at its size, and every caller caps the bytes it reads.
    """
    path = checked_path(path, error_class, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise error_class(f"{printable(path)}: cannot read {what} ({error.strerror or type(error).__name__}); "
                          "check the path and permissions") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise error_class(f"{printable(path)}: {what} must be a regular file, not {_kind_of(info.st_mode)}; give "
                          "the path of a file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), info.st_size


def read_capped(path: Path, max_bytes: int, error_class: type[OffloadPlanError], what: str) -> bytes:
    """The bytes of regular file ``path``, refusing files over ``max_bytes`` before reading them; OSError becomes
    one line."""
    stream, size_bytes = open_regular(Path(path), error_class, what)
    with stream:
        if size_bytes > max_bytes:
            raise error_class(f"{printable(path)}: {size_bytes} bytes is too large for {what} (at most {max_bytes}); "
                              "is this the right file?")
        try:
            return stream.read(max_bytes + 1)
        except OSError as error:
            raise error_class(f"{printable(path)}: cannot read {what} ({error.strerror or type(error).__name__}); "
                              "check the path and permissions") from None


# ---- JSON ---------------------------------------------------------------------------------------------------


def _unique_object(pairs: list) -> dict:
    # the dict is built anyway; only when it came out shorter than the pairs is a key looked for (a safetensors
    # header has one object per tensor: 92k for DeepSeek-V3, so the common case is one C call)
    value = dict(pairs)
    if len(value) != len(pairs):
        keys = [key for key, _ in pairs]
        duplicate = next(key for key in keys if keys.count(key) > 1)
        raise _Refused(f"key {duplicate!r} appears twice")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"a {len(text)}-digit integer")
    return int(text)


#: every byte to b" " but ASCII digits, which become b"0": a JSON integer is a run of ASCII digits (after an
#: optional minus), so a document whose translation holds no run of MAX_INT_DIGITS + 1 zeros has no integer
#: _bounded_int would refuse
_DIGITS_AS_ZERO = bytes(ord("0") if chr(byte).isdigit() and byte < 128 else ord(" ") for byte in range(256))
_LONG_DIGIT_RUN = b"0" * (MAX_INT_DIGITS + 1)


def _may_hold_long_int(raw: bytes) -> bool:
    """Whether ``raw`` has a run of more than MAX_INT_DIGITS ASCII digits anywhere (in a string or a number).

    Found by two C passes over the bytes (translate, then a substring search); json.loads then calls
    _bounded_int for each integer only where one might be too long: on DeepSeek-V3's 129 headers (370k
    integers) the per-integer call was a fifth of parsing them."""
    return _LONG_DIGIT_RUN in raw.translate(_DIGITS_AS_ZERO)


def _no_constant(word: str):
    raise _Refused(f"{word} is not a JSON number")


def _depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion: level by level, stopping past MAX_DEPTH (a level's
    containers gathered in one comprehension: a safetensors header has ~1,000 objects at its second level)."""
    if not isinstance(value, (dict, list)):
        return 1
    level, frontier = 1, [value]
    while frontier and level <= MAX_DEPTH:
        frontier = [child for item in frontier for child in (item.values() if isinstance(item, dict) else item)
                    if isinstance(child, (dict, list))]
        level += 1
    return level - 1 if not frontier else level


def load_json(raw: bytes, origin: str, error_class: type[OffloadPlanError], *, allow_constants: bool = False,
              fix: str = "download it again", nesting_checked_by_caller: bool = False) -> object:
    """Parse untrusted JSON; any problem is one ``error_class`` line naming ``origin`` and ending with ``fix``.

    ``nesting_checked_by_caller``: the caller knows the shape it expects and calls check_nesting itself wherever
    the value is not that shape (the depth walk touches every value: a tenth of reading DeepSeek-V3's headers)."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_unique_object,
                           parse_int=_bounded_int if _may_hold_long_int(raw) else None,
                           parse_constant=None if allow_constants else _no_constant)
    except UnicodeDecodeError as error:
        reason = f"not UTF-8 at byte {error.start}"
    except RecursionError:
        reason = f"nested more than {MAX_DEPTH} levels deep"
    except _Refused as error:
        reason = str(error)
    except json.JSONDecodeError as error:
        reason = f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
    else:
        if nesting_checked_by_caller or _depth(value) <= MAX_DEPTH:
            return value
        reason = f"nested more than {MAX_DEPTH} levels deep"
    raise error_class(f"{origin}: {reason}; {fix}")


def check_nesting(value: object, origin: str, error_class: type[OffloadPlanError], fix: str) -> None:
    """load_json's depth check, for a caller that parsed with ``nesting_checked_by_caller``: the same line."""
    if _depth(value) > MAX_DEPTH:
        raise error_class(f"{origin}: nested more than {MAX_DEPTH} levels deep; {fix}")


# ---- YAML ---------------------------------------------------------------------------------------------------


class _Strict:
    """PyYAML's safe loading without aliases, duplicate keys, unbounded nesting or unbounded integers."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"line {event.start_mark.line + 1} uses an alias (*{event.anchor}); aliases are not "
                           "allowed: write the value out")
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        keys = [key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode)]
        if len(set(keys)) != len(keys):
            duplicate = next(key for key in keys if keys.count(key) > 1)
            raise _Refused(f"line {node.start_mark.line + 1}: key {duplicate!r} appears twice")
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        if len(node.value.replace("_", "").lstrip("+-")) > MAX_INT_DIGITS:
            raise _Refused(f"line {node.start_mark.line + 1}: a {len(node.value)}-digit integer")
        return super().construct_yaml_int(node)


class _PureStrictLoader(_Strict, yaml.SafeLoader):
    """The strict loader in pure Python."""


try:
    from yaml._yaml import CParser
except ImportError:  # PyYAML built without libyaml
    _StrictLoader = _PureStrictLoader
else:
    class _StrictLoader(_Strict, yaml.composer.Composer, CParser, yaml.constructor.SafeConstructor,
                        yaml.resolver.Resolver):
        """libyaml's scanner and parser (several times faster) under the strict Python composer."""

        def __init__(self, stream):
            CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

for _loader in {_StrictLoader, _PureStrictLoader}:
    _loader.add_constructor("tag:yaml.org,2002:int", _Strict.construct_yaml_int)


def load_yaml(raw: bytes, origin: str, error_class: type[OffloadPlanError], fix: str) -> object:
    """Parse untrusted YAML (plans, profiles); any problem is one ``error_class`` line naming ``origin``."""
    try:
        return yaml.load(raw.decode("utf-8"), Loader=_StrictLoader)  # noqa: S506 (SafeConstructor, strict)
    except UnicodeDecodeError as error:
        reason = f"not valid YAML: not UTF-8 at byte {error.start}"
    except _Refused as error:
        reason = str(error)
    except yaml.YAMLError as error:
        reason = f"not valid YAML: {str(error).splitlines()[0]}"
        mark = getattr(error, "problem_mark", None)
        if mark is not None:
            reason += f" (line {mark.line + 1})"
    except (RecursionError, ValueError, OverflowError) as error:  # PyYAML's own int and float constructors
        reason = f"cannot read a value ({type(error).__name__})"
    raise error_class(f"{origin}: {reason}; {fix}")
