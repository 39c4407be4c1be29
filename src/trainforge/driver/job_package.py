"""What ``trainforge submit`` sends: the working directory as one zip built here, secrets left out.

Ray would pack the working directory itself, everything no ignore rule names. trainforge decides
each path instead and hands Ray the finished zip, so that what leaves the machine is exactly the
list ``submit --dry-run`` prints. A path is

- *ignored* as Ray ignores it: trainforge's ``EXCLUDES`` and the run's output folders
  (``jobs.excludes``), Ray's default excludes, every ``.gitignore`` and ``.rayignore`` (Ray's own
  matchers, so the rules read as Ray reads them);
- *withheld* when it holds or names a secret (``withheld_reason``, the one rule, docs/deploy.md):
  key and certificate material and credential files by name (``SECRET_NAMES``), a file or folder
  whose name is secret-named (``redact.is_secret_key``: ``api_token``, ``secrets/``), content that
  is a private key, the cluster's token or a token in a known format (``redact.holds_token_format``),
  binary key material or a credential file's syntax (``secret_files``: DER, PKCS#12, netrc, ...),
  a YAML or JSON file holding what every record of a run masks (the run's own config among them:
  the job runs the resolved copy with its secrets masked), the token file, and every path the
  config names under a secret, key, certificate or TLS key.

``--include PATH`` sends PATH, and everything under it, whatever the rules say.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.config.safeyaml import MAX_FILE_BYTES, load_yaml
from trainforge.driver.secret_files import CODE_SUFFIXES, archived_secret, credential_syntax, key_material
from trainforge.errors import TrainforgeError, printable
from trainforge.redact import holds_token_format, is_secret_key, redact_config

KEY_MATERIAL = "key or certificate material"
CREDENTIALS = "a credentials file"
# Matched, case-insensitively, against a path's names: a pattern with '/' against that many
# consecutive names (".config/gcloud" anywhere in the path), a folder's match covers what is in it.
SECRET_NAMES: list[tuple[str, str]] = [
    *((pattern, KEY_MATERIAL) for pattern in ("*.key", "*.pem", "*.p12", "*.pfx", "*.p8", "*.pk8")),
    *((pattern, KEY_MATERIAL) for pattern in ("*.jks", "*.keystore", "*.crt", "*.cer", "*.der", "*.ppk")),
    *((pattern, KEY_MATERIAL) for pattern in ("id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", ".ssh", ".gnupg")),
    *((pattern, CREDENTIALS) for pattern in (".env", ".env.*", "*.env", ".envrc", ".netrc", "_netrc", ".pgpass")),
    *((pattern, CREDENTIALS) for pattern in (".git-credentials", ".npmrc", ".pypirc", ".aws", ".azure", ".ray")),
    *((pattern, CREDENTIALS) for pattern in (".config/gcloud", ".docker/config.json", ".kube", "kubeconfig")),
    *((pattern, CREDENTIALS) for pattern in ("*.kubeconfig", "*.kdbx", "*.tfstate", "*.tfstate.*")),
]
SNIFF_BYTES = 1 << 20  # the first MiB of every file is read for a private key or the token
STRUCTURED = (".yaml", ".yml", ".json")  # parsed (JSON up to SNIFF_BYTES) for values under secret-named keys
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----|PuTTY-User-Key-File-")
# Config keys whose string values may name a file holding a secret (with is_secret_key's names,
# and names such as token_file, private_key_path: a secret-named key followed by these words).
_SECRET_PLACES = frozenset({"tls", "ssl", "ssh", "cert", "certs", "certificate", "certificates", "ca", "key", "keys"})
_SECRET_PLACES |= frozenset({"keyfile", "keystore", "pem", "credential", "credentials"})
_PLACE_WORDS = frozenset({"file", "files", "path", "paths", "dir", "folder", "filename", "location", "env", "name"})
_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
RESOLVED_CONFIG = "the resolved config, secrets masked"


@dataclass(frozen=True)
class LeftOut:
    path: str  # relative to the working directory, '/'-separated; a folder's ends with '/'
    reason: str


@dataclass
class Contents:
    """What a submission sends from ``root``: ``sent`` (files, and folders that are empty), what
    the secret rule ``withheld``, what ignore rules ``ignored`` (a folder once, not its files)."""

    root: Path
    sent: list[str] = field(default_factory=list)
    withheld: list[LeftOut] = field(default_factory=list)
    ignored: list[LeftOut] = field(default_factory=list)
    included: list[LeftOut] = field(default_factory=list)  # sent by --include although a rule leaves them out


@dataclass(frozen=True)
class Secrets:
    """What the rule looks for besides names: the paths to leave out (the token file, the paths
    the config names) and the values no sent file may hold (the cluster's token)."""

    paths: Mapping[Path, str]  # absolute path -> reason
    values: tuple[bytes, ...] = ()


def package_contents(
    root: Path,
    *,
    config: Mapping[str, Any],
    ignore: list[str],
    token_file: Path | None = None,
    token_values: Iterable[str] = (),
    includes: Iterable[Path] = (),
) -> Contents:
    """Decide every path under ``root``: sent, withheld (the secret rule) or ignored (``ignore``,
    gitignore-style patterns, with Ray's default excludes, ``.gitignore`` and ``.rayignore``)."""
    root = root.resolve()
    secrets = Secrets(
        paths=_named_paths(root, config, token_file),
        values=tuple(value.encode() for value in token_values if value),
    )
    forced = [_inside(root, path, "--include") for path in includes]
    contents = Contents(root)
    _Walk(root, contents, secrets, forced, _ignore_rules(root, ignore)).folder(root, [])
    return contents


class _Walk:
    def __init__(
        self, root: Path, contents: Contents, secrets: Secrets, forced: list[str], ignored: Callable[[Path], bool]
    ) -> None:
        self.root, self.contents, self.secrets, self.forced, self.ignored = root, contents, secrets, forced, ignored
        self.on_the_way: set[str] = set()  # real paths of the folders being walked: a link loop ends

    def folder(self, folder: Path, matchers: list[Callable[[Path], bool]], *, only_forced: bool = False) -> None:
        """Decide what is in ``folder``; ``only_forced``: in a folder left out, only what --include names."""
        from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

        real = os.path.realpath(folder)
        if real in self.on_the_way:
            return
        self.on_the_way.add(real)
        try:
            entries = sorted(folder.iterdir(), key=lambda path: path.name)
            matchers = [*matchers, *get_excludes_from_ignore_files(folder, include_gitignore=_gitignore_read())]
        except OSError as err:
            raise TrainforgeError(f"cannot read {folder} to package it: {err.strerror or err}") from None
        for path in entries:
            rel = path.relative_to(self.root).as_posix()
            below = any(forced.startswith(f"{rel}/") for forced in self.forced)
            if self._forced(rel):
                self._take(path, rel, matchers)
            elif only_forced or self._left_out(path, rel, matchers) is not None:
                if below:
                    self.folder(path, matchers, only_forced=True)
            else:
                self._take(path, rel, matchers)
        self.on_the_way.discard(real)

    def _left_out(self, path: Path, rel: str, matchers: list[Callable[[Path], bool]]) -> LeftOut | None:
        """Why an ignore rule or the secret rule leaves ``path`` out, recorded; None: it is sent."""
        shown = f"{rel}/" if path.is_dir() else rel
        if self.ignored(path) or any(match(path) for match in matchers):
            left = LeftOut(shown, "ignored (excludes, .gitignore, .rayignore)")
            self.contents.ignored.append(left)
            return left
        if not path.is_dir() and not path.is_file():
            left = LeftOut(shown, "not a regular file (a broken link, a FIFO, a socket)")
            self.contents.ignored.append(left)
            return left
        reason = withheld_reason(self.root, path, self.secrets)
        if reason is None:
            return None
        self.contents.withheld.append(LeftOut(shown, reason))
        return self.contents.withheld[-1]

    def _take(self, path: Path, rel: str, matchers: list[Callable[[Path], bool]]) -> None:
        if rel in self.forced:  # what the rules would have said, for --dry-run
            said = Contents(self.root)
            left = _Walk(self.root, said, self.secrets, [], self.ignored)._left_out(path, rel, matchers)
            if left is not None:
                self.contents.included.append(left)
        if path.is_dir():
            self.folder(path, matchers)
            if not any(path.iterdir()):  # Ray packs an empty folder too
                self.contents.sent.append(f"{rel}/")
        elif path.is_file():
            self.contents.sent.append(rel)

    def _forced(self, rel: str) -> bool:
        return any(rel == forced or rel.startswith(f"{forced}/") for forced in self.forced)


def withheld_reason(root: Path, path: Path, secrets: Secrets) -> str | None:
    """Why ``path`` (under ``root``) is left out of the package, or None: the one rule."""
    names = list(path.relative_to(root).parts)
    reason = _by_name(names, python=_is_python(path), folder=path.is_dir())
    if reason is None and path.is_symlink():  # a link is judged by where it leads too
        target = Path(os.path.realpath(path))
        parts = target.relative_to(root).parts if target.is_relative_to(root) else target.parts[1:]
        reason = _by_name(list(parts), python=_is_python(target), folder=target.is_dir())
        reason = reason and f"a link to {target}: {reason}"
    if reason is None:
        reason = _named(path, secrets.paths)
    if reason is None and path.is_file():
        reason = _by_content(path, secrets.values)
    return reason


def _by_name(names: list[str], *, python: bool, folder: bool) -> str | None:
    lowered = [name.lower() for name in names]
    for pattern, reason in SECRET_NAMES:
        steps = pattern.split("/")
        for start in range(len(lowered) - len(steps) + 1):
            if all(fnmatch.fnmatchcase(name, step) for name, step in zip(lowered[start:], steps, strict=False)):
                return f"{reason} ({pattern})"
    # A Python module or package is code the job imports: its name says what it is about (auth.py).
    for index, name in enumerate(names):
        last = index == len(names) - 1
        if python and last:
            continue
        stem = name.lstrip(".").split(".")[0]
        if is_secret_key(stem):
            return f"a secret-named {'file' if last and not folder else 'folder'} ({name})"
    return None


def _is_python(path: Path) -> bool:
    return path.suffix in (".py", ".pyi") or (path.is_dir() and (path / "__init__.py").is_file())


def _named(path: Path, named: Mapping[Path, str]) -> str | None:
    here = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    for secret, reason in named.items():
        if here == secret or real == secret:
            return reason
    return None


def _by_content(path: Path, values: tuple[bytes, ...]) -> str | None:
    try:
        with open(path, "rb") as file:
            head = file.read(SNIFF_BYTES)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return None  # unreadable here: Ray could not pack it either, and says so
    if _PRIVATE_KEY.search(head):
        return "holds a private key"
    if any(value in head for value in values):
        return "holds the cluster's token"
    if holds_token_format(head.decode("utf-8", errors="replace")):
        return "holds a token in a known format (as the records mask it)"
    reason = key_material(head, size) or archived_secret(path, head, size, _member_by_name)
    if reason is None and path.suffix.lower() in STRUCTURED and len(head) < SNIFF_BYTES:
        keys = _secret_keys(head, json_text=path.suffix.lower() == ".json")
        reason = f"holds a secret ({keys[0]})" if keys else None
    return reason or credential_syntax(head, code=path.suffix.lower() in CODE_SUFFIXES)


def _member_by_name(names: list[str]) -> str | None:
    """The rule for names, for a member of an archive (a ``.py`` member is code, as in a folder)."""
    return _by_name(names, python=bool(names) and names[-1].endswith(CODE_SUFFIXES), folder=False)


def _secret_keys(data: bytes, *, json_text: bool) -> list[str]:
    """The dotted keys of a JSON or YAML document whose values ``redact_config`` masks (whole, or
    the credentials of a URI); none for
    a document that is not one, or a YAML one past ``load_yaml``'s bounds (a config's are far within)."""
    try:
        if json_text:
            tree = json.loads(data)
        elif len(data) <= MAX_FILE_BYTES:
            tree = load_yaml(data.decode("utf-8"), "a file to package")
        else:
            return []
    except (TrainforgeError, ValueError, RecursionError):
        return []
    return [".".join(map(str, keys)) for keys, _ in _masked_leaves(tree, redact_config(tree), [])]


def _masked_leaves(real: Any, shown: Any, keys: list[Any]) -> Iterator[tuple[list[Any], Any]]:
    if isinstance(real, Mapping) and isinstance(shown, Mapping):
        for key, value in real.items():
            yield from _masked_leaves(value, shown.get(key), [*keys, key])
    elif isinstance(real, list) and isinstance(shown, list):
        for index, (item, masked) in enumerate(zip(real, shown, strict=False)):
            yield from _masked_leaves(item, masked, [*keys, index])
    elif isinstance(real, str) and real != shown:  # masked whole, or a credential in a URI
        yield keys, real


def _named_paths(root: Path, config: Mapping[str, Any], token_file: Path | None) -> dict[Path, str]:
    """The token file and every path under ``root`` that a secret-naming config key names."""
    found: dict[Path, str] = {}
    token_paths = [("--token-file", token_file), ("RAY_AUTH_TOKEN_PATH", os.environ.get("RAY_AUTH_TOKEN_PATH"))]
    for source, value in token_paths:
        if value:
            _add(found, root, Path(value).expanduser(), f"the token file ({source})")
    for keys, value in _config_strings(config, []):
        if any(_names_a_secret(str(key)) for key in keys):
            dotted = ".".join(str(key) for key in keys)
            _add(found, root, Path(value).expanduser(), f"named by the config's {dotted}")
    return found


def _add(found: dict[Path, str], root: Path, path: Path, reason: str) -> None:
    path = path if path.is_absolute() else root / path
    for candidate in {Path(os.path.abspath(path)), Path(os.path.realpath(path))}:
        if candidate.is_relative_to(root) and candidate != root and os.path.lexists(candidate):
            found.setdefault(candidate, reason)


def _config_strings(tree: Any, keys: list[Any]) -> Iterator[tuple[list[Any], str]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _config_strings(value, [*keys, key])
    elif isinstance(tree, (list, tuple)):
        for index, item in enumerate(tree):
            yield from _config_strings(item, [*keys, index])
    elif isinstance(tree, str) and tree and "\0" not in tree and len(tree) < 4096:
        yield keys, tree


def _names_a_secret(key: str) -> bool:
    """A config key whose value is a secret, or names where one is (``token_file``,
    ``private_key_path``, ``cluster.tls``'s ``key``, ``cert``, ``ca``)."""
    words = [word.lower() for word in _WORD.findall(key)]
    if is_secret_key(key) or _SECRET_PLACES.intersection(words):
        return True
    while words and words[-1] in _PLACE_WORDS:
        words.pop()
    return bool(words) and is_secret_key(" ".join(words))


def _inside(root: Path, path: Path, flag: str) -> str:
    """``path`` (absolute, or relative to the working directory) as a path relative to ``root``."""
    absolute = Path(os.path.abspath(path if path.is_absolute() else root / path))
    if not absolute.is_relative_to(root) or absolute == root:
        raise TrainforgeError(f"{flag} {path}: not a path inside the working directory {root}")
    if not os.path.lexists(absolute):
        raise TrainforgeError(f"{flag} {path}: no such file or folder in {root}")
    return absolute.relative_to(root).as_posix()


def _ignore_rules(root: Path, patterns: list[str]) -> Callable[[Path], bool]:
    from ray._private.ray_constants import get_runtime_env_default_excludes
    from ray._private.thirdparty.pathspec import PathSpec

    spec = PathSpec.from_lines("gitwildmatch", [*get_runtime_env_default_excludes(), *patterns])
    return lambda path: bool(spec.match_file(path.relative_to(root).as_posix()))


def _gitignore_read() -> bool:
    """Ray reads .gitignore files unless RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 (its own switch)."""
    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE

    return os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"


@contextmanager
def written_package(contents: Contents, extra: Mapping[str, str]) -> Iterator[Path]:
    """The zip of ``contents.sent`` (and ``extra``: name -> text, the resolved config) in a private
    temporary folder, removed afterwards: Ray uploads it as the job's working directory."""
    folder = Path(tempfile.mkdtemp(prefix="trainforge-package-"))
    try:
        package = folder / "working_dir.zip"
        try:
            with zipfile.ZipFile(package, "w", zipfile.ZIP_DEFLATED, strict_timestamps=False) as archive:
                for rel in contents.sent:
                    archive.write(contents.root / rel, rel)
                for name, text in extra.items():
                    info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
                    info.external_attr = (stat.S_IFREG | 0o644) << 16
                    archive.writestr(info, text, zipfile.ZIP_DEFLATED)
        except OSError as err:
            raise TrainforgeError(f"cannot package the working directory {contents.root}: {err}") from None
        yield package
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summary_line(contents: Contents) -> str | None:
    """One line on what the secret rule left out (None when nothing): ``submit`` prints it."""
    if not contents.withheld:
        return None
    shown = ", ".join(left.path for left in contents.withheld[:4])
    more = f" and {len(contents.withheld) - 4} more" if len(contents.withheld) > 4 else ""
    return printable(
        f"left out of the package as secrets: {shown}{more} "
        "(trainforge submit --dry-run says why; --include PATH sends one)"
    )


def dry_run_lines(contents: Contents, extra: Iterable[str]) -> list[str]:
    """``submit --dry-run``: what would be sent, what the secret rule left out and why, what was ignored."""
    sent = [*contents.sent, *(f"{name}  ({RESOLVED_CONFIG})" for name in extra)]
    lines = [f"would send {len(sent)} from {contents.root}:", *(f"  {path}" for path in sent)]
    if contents.included:
        lines.append("sent by --include:")
    lines += [f"  {left.path}  (--include, although {left.reason})" for left in contents.included]
    lines.append(f"left out as secrets: {len(contents.withheld)} (--include PATH sends one)")
    lines += [f"  {left.path}  ({left.reason})" for left in contents.withheld]
    lines.append(f"ignored: {len(contents.ignored)}")
    lines += [f"  {left.path}" for left in contents.ignored]
    return [printable(line) for line in lines]  # names read from the disk, printed as data
