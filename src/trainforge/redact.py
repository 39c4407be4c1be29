"""Credentials out of everything a run writes or prints.

A storage or tracking URI may carry its credentials: ``s3://KEY:SECRET@bucket/prefix``,
``https://user:pass@mlflow.example.com``, ``...?X-Amz-Signature=...&token=...``. The run itself
uses the real values (the config object handed to Ray and the workers is never redacted); every
record of the run (config.yaml, summary.json, trainer_state.json, MLflow params, the report, log
lines and the console) goes through this module first. docs/security.md lists where it applies.

Worker code imports this module too (trainer_state.json is written on a worker): it depends on
nothing but the standard library and ``errors`` (a leaf).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from typing import Any

from trainforge.errors import mask_messages_with, printable

MASK = "***"

# ``scheme://userinfo@``: the userinfo ends at the last '@' before the host; it cannot contain an
# unencoded '/', '?', '#' or whitespace, so the match never runs past the authority.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s?#'\"<>]*)@")

# A config key, a query parameter, an environment variable or a key quoted in a message is secret
# when its name says so. The name is split into lower-case words at every separator and camelCase
# boundary (``hf_token`` -> hf token, ``secretKey`` -> secret key, ``X-Api-Key`` -> x api key);
# trailing digits are dropped (``password2``). Then, in this order:
# 1. a name that ends by saying where a secret is or what it is about (``token_file``,
#    ``private_key_path``, ``key_env``, ``secret_name``, ``password_length``, ``kms_key_id``) is
#    not secret: its value is a path, a variable's name, an identifier or a number; but
#    ``session_id`` is (a session's id is its credential);
# 2. words that say how a value is written (``value``, ``pem``, ``b64``, ``header``, ...) are
#    dropped from the end: ``private_key_pem`` and ``client_secret_value`` are judged as
#    ``private key`` and ``client secret``; a name of nothing else but ``pem``/``der`` is secret;
# 3. the name is secret when its last word is a secret word (``_SECRET_WORDS``), is ``key(s)``
#    after a word that is not a data field's (``api_key``, ``hmac_key``; not ``sort_key``, bare
#    ``key``), is ``token`` after anything but a vocabulary word (``hf_token``; not ``eos_token``),
#    is ``tokens`` after a credential's word (``auth_tokens``; not ``max_tokens``), or ends run
#    together with a secret word (``dbpassword``, ``APIKEY``, ``oauth``, ``sessionid``);
# 4. or when any of its words is an unambiguous secret word (``password_hash``, ``cookie_jar``).
# A false positive hides a harmless value from the records; a false negative writes a credential
# into them: when in doubt, a name is secret. docs/security.md lists the rule.
_SECRET_WORDS = frozenset(
    {"token", "password", "passwd", "pass", "pwd", "passphrase", "secret", "credential", "creds", "auth"}
    | {"passwords", "passphrases", "secrets", "credentials", "signature", "signatures", "authorization"}
    | {"authentication", "bearer", "cookie", "cookies", "session", "otp", "totp", "jwt", "dsn", "salt"}
    | {"apikey", "apikeys", "privkey", "private", "pem", "der", "pin", "hmac", "sig", "passcode", "passcodes"}
    | {"pat", "sas"}  # a personal access token (github_pat), an Azure shared access signature
)
# Secret wherever they stand in a name (unless its last word is a descriptor, rule 1).
_ANYWHERE = frozenset(
    {"password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials", "creds"}
    | {"authorization", "bearer", "cookie", "cookies", "apikey", "privkey", "jwt", "passcode", "passcodes"}
)
# Rule 1: the name's last word says where the secret is, what it is called or how it is shaped.
_DESCRIPTORS = frozenset(
    {"file", "files", "path", "paths", "dir", "dirs", "directory", "folder", "env", "var", "vars", "variable"}
    | {"name", "names", "id", "ids", "url", "uri", "endpoint", "host", "kind", "type", "length", "len", "size"}
    | {"bits", "count", "mode", "format", "enabled", "required", "provider", "source", "version", "ttl", "timeout"}
    | {"expiry", "expires", "lifetime", "algorithm", "alg", "scheme", "prefix", "field", "column", "location"}
)
# Rule 2: how a value is written, not what it is.
_ENCODINGS = frozenset(
    {"value", "values", "str", "string", "text", "raw", "data", "bytes", "b64", "base64", "hex", "pem", "der"}
    | {"encoded", "content", "contents", "json", "header", "headers", "material", "blob", "literal", "plain"}
)
# "<w> key" is a secret (api_key, hmac_key, privateKey) unless <w> names what a data key indexes.
_FIELD_WORDS = frozenset(
    {"sort", "primary", "foreign", "partition", "cache", "dict", "lookup", "group", "column", "text", "label"}
    | {"input", "inputs", "output", "target", "image", "metric", "hash", "shard", "row", "index", "map", "join"}
    | {"order", "unique", "composite", "range", "feature", "batch", "state", "config", "param", "public"}
    | {"dataset", "split", "field", "name", "keep", "top", "sample", "id", "media", "audio", "video", "prompt"}
)
# "<v> token" names a word of a tokenizer's vocabulary (eos_token: "</s>"), not a credential.
_VOCABULARY = frozenset(
    {"bos", "eos", "sos", "eot", "pad", "padding", "unk", "unknown", "cls", "sep", "mask", "start", "end", "stop"}
    | {"begin", "special", "image", "audio", "video"}
)
# "tokens" is mostly a count or a list of vocabulary words (max_tokens); "<q> tokens" is credentials.
_TOKENS_QUALIFIERS = frozenset({"access", "auth", "api", "refresh", "session", "bearer", "id", "oauth", "github"})
# Run-together names (``dbpassword``, ``APIKEY`` of an environment variable) that cannot be split:
# a last word ending in one of these. Only suffixes no harmless word ends with.
_SECRET_SUFFIXES = (
    "password",
    "passwords",
    "passwd",
    "passphrase",
    "secret",
    "secrets",
    "credential",
    "credentials",
    "cookie",
    "auth",
    "bearer",
    "sessionid",
    "apikey",
    "apikeys",
    "privkey",
    *(f"{q}key" for q in ("secret", "private", "access", "encryption", "signing", "master", "hmac", "session")),
    *(f"{q}token" for q in _TOKENS_QUALIFIERS | {"hf", "bot", "app", "user", "personal"}),
)
# Query parameters only: Azure's SAS signature (sig=) and Google's API keys (key=), whole names.
_SECRET_PARAMETERS = frozenset({"sig", "key"})

_WORD = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+[0-9]*|[A-Z]+[0-9]*|[0-9]+")
_QUERY_PARAM = re.compile(r"(?P<name>[?&;#](?P<key>[\w.\-]+))=(?P<value>[^&;#\s'\"<>]*)")


def _name_words(name: str) -> list[str]:
    """``name`` as lower-case words: split at every character that is not a letter or a digit and at
    camelCase boundaries (``APIKey`` -> api key); a word's trailing digits dropped (``password2``,
    ``secret2_value``), but for an encoding's name (``b64``)."""
    words = [word.lower() for word in _WORD.findall(name)]
    words = [word if word in _ENCODINGS else word.rstrip("0123456789") for word in words]
    return [word for word in words if word]


@functools.lru_cache(maxsize=4096)
def is_secret_key(name: str) -> bool:
    """Whether a value under the name ``name`` (a config key, a query parameter, an environment
    variable, a keyword argument) is a secret, whatever it looks like: the rule above."""
    words = _name_words(name)
    if words[-2:] == ["session", "id"]:
        return True  # the session's own id is its credential (a cookie's value)
    if not words or words[-1] in _DESCRIPTORS:
        return False
    if any(word in _ANYWHERE for word in words):
        return True
    kept = list(words)
    while kept and kept[-1] in _ENCODINGS:
        kept.pop()
    if not kept:
        return words[-1] in ("pem", "der")
    last, before = kept[-1], kept[-2] if len(kept) > 1 else ""
    if last == "token":
        return before not in _VOCABULARY
    if last == "tokens":
        return before in _TOKENS_QUALIFIERS
    if last in ("key", "keys"):
        # A key written out (key_pem, keyB64) is a key's material, even without a qualifier.
        return before not in _FIELD_WORDS if before else len(kept) < len(words)
    return last in _SECRET_WORDS or last.endswith(_SECRET_SUFFIXES)


def _is_secret_parameter(name: str) -> bool:
    return name.lower() in _SECRET_PARAMETERS or is_secret_key(name)


def _mask_userinfo(match: re.Match[str]) -> str:
    user, colon, _password = match.group("userinfo").partition(":")
    # user:password keeps the user (who connected says something); a lone name is a token.
    masked = f"{user}:{MASK}" if colon and user else MASK
    return f"{match.group('scheme')}{masked}@"


# Values that are credentials by their look, whatever names them. Each is a published format with a
# fixed prefix; a bare hex or base64 string (a SHA-256 of a checkpoint, a run id) is not one of them.
_TOKEN_FORMATS = re.compile(
    "|".join(
        [
            r"\bhf_[A-Za-z0-9]{30,}",  # Hugging Face
            r"\bgh[pousr]_[A-Za-z0-9]{30,}",  # GitHub classic and app tokens
            r"\bgithub_pat_[A-Za-z0-9_]{22,}",  # GitHub fine-grained
            r"\bgl(?:pat|ptt|dt|rt|cbt|ft|imt|oas|soat|agent)-[A-Za-z0-9_\-]{20,}",  # GitLab's tokens
            r"\bsk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_\-]{20,}",  # OpenAI, Anthropic (sk-ant-...)
            r"\b[rsp]k_(?:live|test)_[A-Za-z0-9]{16,}",  # Stripe
            r"\bxox[abposr]-[A-Za-z0-9\-]{10,}",  # Slack
            r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}\b",  # AWS access key ids
            r"\bAIza[0-9A-Za-z_\-]{35}",  # Google API keys
            r"\bnpm_[A-Za-z0-9]{36}",  # npm
            r"\bpypi-[A-Za-z0-9_\-]{50,}",  # PyPI
            r"\bdop_v1_[a-f0-9]{64}",  # DigitalOcean
            r"\bya29\.[A-Za-z0-9_\-]{30,}",  # Google OAuth access tokens
            r"\bdckr_pat_[A-Za-z0-9_\-]{20,}",  # Docker Hub
            r"\bhv[sbr]\.[A-Za-z0-9_\-]{24,}",  # HashiCorp Vault
            r"\bgl(?:sa|c)_[A-Za-z0-9_\-=+/]{32,}",  # Grafana
            r"\bSG\.[A-Za-z0-9_\-]{16,}\.[A-Za-z0-9_\-]{16,}",  # SendGrid
            r"\bshp(?:at|ss|ca|pa)_[a-fA-F0-9]{32}",  # Shopify
            r"\bxapp-[0-9]+-[A-Za-z0-9\-]{20,}",  # Slack app-level tokens
            r"\blin_api_[A-Za-z0-9]{32,}",  # Linear
            r"\bdapi[a-f0-9]{32}(?:-[0-9]+)?\b",  # Databricks
            r"\bAGE-SECRET-KEY-1[0-9A-Z]{50,}",  # age
            r"\bATATT3[A-Za-z0-9_\-=]{40,}",  # Atlassian
            r"\br8_[A-Za-z0-9]{37}\b",  # Replicate
            r"\bgsk_[A-Za-z0-9]{40,}",  # Groq
            r"\beyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*",  # JWT (header.payload.signature)
            r"(?<=hooks\.slack\.com/services/)[A-Za-z0-9/]{20,}",  # a Slack webhook's path is its secret
            r"(?<=/api/webhooks/)[0-9]+/[A-Za-z0-9_\-]{20,}",  # Discord's
        ]
    )
)
# What each format above begins with, to look for the formats only in a text that holds one.
_TOKEN_PREFIXES = (
    *("hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat-", "sk-", "k_live_", "k_test_"),
    *("xox", "AKIA", "ASIA", "AGPA"),
    *("AIDA", "AROA", "ANPA", "ANVA", "AIPA", "AIza", "npm_", "pypi-", "dop_v1_", "eyJ", "hooks.slack.com/"),
    "/api/webhooks/",
    *("glptt-", "gldt-", "glrt-", "glcbt-", "glft-", "glimt-", "gloas-", "glsoat-", "glagent-", "ya29."),
    *("dckr_pat_", "hvs.", "hvb.", "hvr.", "glsa_", "glc_", "SG.", "shpat_", "shpss_", "shpca_", "shppa_"),
    *("xapp-", "lin_api_", "dapi", "AGE-SECRET-KEY-1", "ATATT3", "r8_", "gsk_"),
)
# A PEM private key (RSA, EC, OPENSSH, ENCRYPTED, ...) to its end line, or to the end of the text
# when it was cut; also with its newlines escaped (a repr).
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*)PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.DOTALL
)
# ``Authorization: Bearer <token>``, ``Basic <base64>``: the scheme's word is kept.
_AUTH_SCHEME = re.compile(r"\b(?P<scheme>[Bb]earer|BEARER|[Bb]asic|BASIC)\s+(?P<token>[A-Za-z0-9._~+/\-]{8,}=*)")
# ``name=value``, ``name: value``, ``'name': value``, ``"name"=value`` in any text (a dict's or a
# call's repr, JSON, YAML, an environment line); whether the value is masked is the name's rule.
_NAMED = re.compile(
    r"""(?P<q>['"]?)(?P<name>(?<![\w.\-/\\])-{0,2}[A-Za-z_][\w.\-]*)(?P=q)(?P<sep>[ \t]*(?::=|=>|[:=])[ \t]*)"""
)
# ``<password>value</password>``: an XML element (a settings file, a SOAP fault) named like a secret.
_XML_ELEMENT = re.compile(r"<(?P<name>[A-Za-z_][\w.\-:]*)(?:\s[^<>]*)?>(?P<value>[^<]{1,10000})</(?P=name)\s*>")
_BARE_VALUE = re.compile(
    r"""(?:(?:[Bb]earer|[Bb]asic|[Tt]oken)[ \t]+)?[^\s,;&#'"`<>(){}\[\]=][^\s,;&#'"`<>(){}\[\]]*"""
)
_CLOSING = {"{": "}", "[": "]", "(": ")"}
_LONGEST = 10_000  # characters of one masked value: past them, the rest of a value stays masked by its look
_LABEL_WORD = re.compile(r"([A-Z][A-Za-z]*)[ ]$")  # a label's word is capitalised: "API Key", not "expected key"
# ``--password VALUE``, ``'--api-key', 'VALUE'``: a command line quoted in a message (a usage line,
# subprocess's CalledProcessError); whether the value is masked is the flag's name's rule.
_FLAG = re.compile(
    r"""(?<![\w\-])(?P<flag>-{1,2}[A-Za-z][\w\-]*)(?:[ \t]+|(?P<q>['"]),[ \t]*(?P=q))(?P<value>[^\s'",\])]+)"""
)
# ``{name: HF_TOKEN, value: ...}``: a list of name/value pairs (HTTP headers, Kubernetes env entries,
# Postman variables) in JSON, YAML or a repr; the value is masked when the name is secret-named.
_NAME_VALUE = re.compile(
    r"""(?<![\w.\-])(?P<q1>['"]?)(?:name|key|Name|Key)(?P=q1)[ \t]*[:=][ \t]*"""
    r"""(?P<q2>['"]?)(?P<secret>[A-Za-z_][\w.\-]*)(?P=q2)[ \t]*,?\s*"""
    r"""(?P<q3>['"]?)(?:value|Value)(?P=q3)[ \t]*[:=][ \t]*"""
)
_FLAG_ITEM = re.compile(r"-{1,2}[A-Za-z][\w\-]*")
_PAIR_NAMES = ("name", "key", "Name", "Key")
_PAIR_VALUES = ("value", "Value")
# ``('name', 'value')``: a pair in a list of headers or items.
_PAIR = re.compile(
    r"""\(\s*(?P<q>['"])(?P<name>[^'"\n]{1,100})(?P=q)\s*,\s*(?P<value>'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")\s*\)"""
)


def _mask_token_format(match: re.Match[str]) -> str:
    return MASK


def _mask_private_key(match: re.Match[str]) -> str:
    return f"-----BEGIN {match.group('kind')}PRIVATE KEY-----{MASK}"


def _mask_auth_scheme(match: re.Match[str]) -> str:
    token = match.group("token").rstrip(".")
    # "Bearer" and "Basic" are also English words: a credential has a digit or a symbol, or is long.
    if _looks_like_credential(token):
        return f"{match.group('scheme')} {MASK}"
    return match.group(0)


def _looks_like_credential(value: str) -> bool:
    """Long, or not a word nor a small number (``2 restarts`` is prose, ``hunter2`` is not)."""
    return len(value) >= 16 or (len(value) >= 6 and any(not c.isalpha() for c in value))


def _in_prose_a_credential(value: str) -> bool:
    """After ``word:`` in a sentence: a credential's look, and not a path's (``/x``, ``./x``, ``a/b``)."""
    return _looks_like_credential(value) and not value.startswith(("/", "~", ".")) and "/" not in value


def _value_end(text: str, start: int) -> int:
    """Where the value that begins at ``start`` ends: a quoted string with its quotes, a bracketed
    structure with what it nests (quotes inside respected), else a run of non-delimiters."""
    if start >= len(text):
        return start
    if text[start] in "bBrRuUfF" and text[start + 1 : start + 2] in ("'", '"'):
        start += 1  # b'...', r"...": a prefixed string literal
    first = text[start]
    if first in "'\"":
        i, stop = start + 1, min(len(text), start + _LONGEST)
        while i < stop and text[i] != first:
            i += 2 if text[i] == "\\" else 1
        return min(i + 1, len(text))
    if first in _CLOSING:
        # A structure never closed (a cut text) is masked to its end, or to _LONGEST: bounded work.
        stack, i, stop = [_CLOSING[first]], start + 1, min(len(text), start + _LONGEST)
        while i < stop and stack:
            c = text[i]
            if c in "'\"":
                i = _value_end(text, i)
                continue
            if c in _CLOSING:
                stack.append(_CLOSING[c])
            elif c == stack[-1]:
                stack.pop()
            i += 1
        return i
    bare = _BARE_VALUE.match(text, start)
    return bare.end() if bare else start


def _names_a_secret(text: str, match: re.Match[str]) -> bool:
    """``is_secret_key`` of the name; a label's last word ``Key`` is judged with the word before it
    (``API Key: ...``, ``Private key = ...``)."""
    name = match.group("name")
    if is_secret_key(name):
        return True
    if match.group("q") or name.lower() not in ("key", "keys"):
        return False
    before = _LABEL_WORD.search(text, 0, match.start())
    return before is not None and is_secret_key(f"{before.group(1)}_{name}")


def _mask_pair(match: re.Match[str]) -> str:
    """``('Authorization', 'Bearer x')``, a header list's item: the value masked when the name is secret."""
    if not is_secret_key(match.group("name")):
        return match.group(0)
    value = match.group("value")
    return match.group(0).replace(value, f"{value[0]}{MASK}{value[0]}")


def _mask_flag(match: re.Match[str]) -> str:
    value = match.group("value")
    if value.startswith("-") or not _looks_like_credential(value) or not is_secret_key(match.group("flag")):
        return match.group(0)
    return match.group(0)[: match.start("value") - match.start()] + MASK


def _mask_xml_element(match: re.Match[str]) -> str:
    value = match.group("value")
    if value.strip() in ("", MASK) or not is_secret_key(match.group("name").rpartition(":")[2]):
        return match.group(0)
    start, end = match.start("value") - match.start(), match.end("value") - match.start()
    return match.group(0)[:start] + MASK + match.group(0)[end:]


def _mask_name_value_pairs(text: str) -> str:
    """The value of every ``{name: SECRET_NAME, value: ...}`` pair masked (a nested one whole)."""
    out, done = [], 0
    for match in _NAME_VALUE.finditer(text):
        if match.start() < done or not is_secret_key(match.group("secret")):
            continue
        start = match.end()
        end = _value_end(text, start)
        if end > start and text[start:end].strip("'\"") not in (MASK, ""):
            out.append(text[done:start] + _masked_literal(text[start:end]))
            done = end
    return "".join(out) + text[done:] if out else text


def _masked_literal(value: str) -> str:
    """``***`` in place of ``value``, a quoted string keeping its quotes."""
    quote = value[-1] if value[-1] in "'\"" and len(value) > 1 else ""
    return f"{quote}{MASK}{quote}"


def _names_a_secret_pair(tree: Mapping[Any, Any]) -> bool:
    """``{name: HF_TOKEN, value: ...}``: a mapping whose value is a secret by its pair's name."""
    return any(key in tree for key in _PAIR_VALUES) and any(
        isinstance(tree.get(key), str) and is_secret_key(tree[key]) for key in _PAIR_NAMES
    )


def _mask_named_values(text: str) -> str:
    """Every value that follows a secret name (``is_secret_key``) and ``=`` or ``:`` masked: a
    quoted string keeps its quotes, a nested structure becomes ``***`` whole."""
    out, done = [], 0
    for match in _NAMED.finditer(text):
        if match.start() < done or not _names_a_secret(text, match):
            continue
        start = match.end()
        end = _value_end(text, start)
        value = text[start:end]
        if end == start or value.strip("'\"") in (MASK, ""):
            continue
        name = match.group("name")
        prose = (name.isalpha() and name.islower()) or "." in name
        if not match.group("q") and ":" in match.group("sep") and prose and not _in_prose_a_credential(value):
            # "the token: check it", "node.key: the key is ...", "secrets: certs/ca.key" are prose (or
            # a file's name); "password: hunter2", "model.kwargs.hf_token: <long value>" are not.
            continue
        out.append(text[done:start] + _masked_literal(value))
        done = end
    return "".join(out) + text[done:] if out else text


def redact_text(text: str) -> str:
    """``text`` with every credential masked: values in a known token format (``_TOKEN_FORMATS``,
    private keys, ``Bearer <token>``), the userinfo of every URI, values after a secret name
    (``name=value``, ``'name': value``, however nested), and the secret values the process was
    given (``remember_secrets``)."""
    found = [secret for secret in _REMEMBERED if secret in text]
    for secret in sorted(found, key=len, reverse=True):  # a longer secret before one it holds
        text = text.replace(secret, MASK)
    if any(prefix in text for prefix in _TOKEN_PREFIXES):  # a substring search is much faster than the regex
        text = _TOKEN_FORMATS.sub(_mask_token_format, text)
    if "PRIVATE KEY-----" in text:
        text = _PRIVATE_KEY.sub(_mask_private_key, text)
    if any(word in text for word in ("earer", "EARER", "asic", "ASIC")):
        text = _AUTH_SCHEME.sub(_mask_auth_scheme, text)
    if "(" in text:
        text = _PAIR.sub(_mask_pair, text)
    if "-" in text:
        text = _FLAG.sub(_mask_flag, text)
    if "@" not in text and "=" not in text and ":" not in text:
        return text
    text = _USERINFO.sub(_mask_userinfo, text)
    text = _QUERY_PARAM.sub(_mask_parameter, text)
    if "alue" in text:
        text = _mask_name_value_pairs(text)
    if "</" in text:
        text = _XML_ELEMENT.sub(_mask_xml_element, text)
    return _mask_named_values(text)


def holds_token_format(text: str) -> str | None:
    """The first value in ``text`` that is a credential by its look (``_TOKEN_FORMATS``, a private
    key), or None: what ``redact_text`` masks whatever names it (``submit`` leaves such files home)."""
    found = _TOKEN_FORMATS.search(text) if any(prefix in text for prefix in _TOKEN_PREFIXES) else None
    if found is None and "PRIVATE KEY-----" in text:
        found = _PRIVATE_KEY.search(text)
    return found.group(0) if found else None


def masked_values(text: str) -> list[str]:
    """The pieces of ``text`` that ``redact_text`` replaces with ``***``, in order (where masks touch,
    their pieces run together): what ``submit`` judges a file's credentials by."""
    redacted = redact_text(text)
    if redacted == text:
        return []
    parts = redacted.split(MASK)
    if not text.startswith(parts[0]):
        return [text]
    values: list[str] = []
    pos = len(parts[0])
    for index, part in enumerate(parts[1:], 1):
        last = index == len(parts) - 1
        end = (len(text) - len(part) if text.endswith(part) else -1) if last else text.find(part, pos + 1)
        if end < pos:
            return [*values, text[pos:]]
        values.append(text[pos:end])
        pos = end + len(part)
    return values


def _mask_parameter(match: re.Match[str]) -> str:
    if match.group("value") and _is_secret_parameter(match.group("key")):
        return f"{match.group('name')}={MASK}"
    return match.group(0)


# The values under secret names of the configs this process resolved: masked wherever they appear,
# whatever names them (a factory's message that quotes its token, a library's repr). Strings with a
# credential's look only (``_looks_like_credential``): no word of an ordinary message is one, so a
# config (a run directory's is not trusted) cannot hide words of the output by naming them secrets.
_REMEMBERED: set[str] = set()
_MAX_REMEMBERED = 1000


def remember_secrets(tree: Any) -> None:
    """Note every string value under a secret-named key of ``tree`` (a config, any JSON-like
    tree), however deep: ``redact_text`` masks it from now on, in this process."""
    for value in _secret_values(tree, False):
        if _looks_like_credential(value) and len(_REMEMBERED) < _MAX_REMEMBERED and MASK not in value:
            _REMEMBERED.add(value)


def _secret_values(tree: Any, secret: bool) -> list[str]:
    if isinstance(tree, Mapping):
        pair = _names_a_secret_pair(tree)
        return [
            v
            for key, value in tree.items()
            for v in _secret_values(value, secret or is_secret_key(str(key)) or (pair and key in _PAIR_VALUES))
        ]
    if isinstance(tree, (list, tuple)):
        after_flag = [False, *(_is_secret_flag(item) for item in tree[:-1])]
        return [
            v for item, flagged in zip(tree, after_flag, strict=False) for v in _secret_values(item, secret or flagged)
        ]
    return [tree] if secret and isinstance(tree, str) else []


def _is_secret_flag(item: Any) -> bool:
    """``--password`` as an item of an argument list: the item after it is its value."""
    return isinstance(item, str) and _FLAG_ITEM.fullmatch(item) is not None and is_secret_key(item)


def redact_config(tree: Any) -> Any:
    """A copy of a config dump (``Config.to_dict()``, or any JSON-like tree) fit to be written:
    strings go through ``redact_text``; everything under a secret-named key (``is_secret_key``) is
    masked whole: each of its values, however deep, becomes ``***`` (None and "" stay: no secret)."""
    if isinstance(tree, Mapping):
        pair = _names_a_secret_pair(tree)  # {name: HF_TOKEN, value: ...}
        shown = {}
        for key, value in tree.items():
            secret = is_secret_key(str(key)) or (pair and key in _PAIR_VALUES)
            # A key is text too: a token used as a mapping's key is masked like any other.
            shown[redact_text(key) if isinstance(key, str) else key] = (
                _masked(value) if secret else redact_config(value)
            )
        return shown
    if isinstance(tree, (list, tuple)):  # ["--password", VALUE]: an argument list's value by its flag
        after_flag = [False, *(_is_secret_flag(item) for item in tree[:-1])]
        return [
            _masked(item) if flagged else redact_config(item) for item, flagged in zip(tree, after_flag, strict=False)
        ]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree


def redact_strings(tree: Any) -> Any:
    """A copy of a JSON-like record (a report, an event) whose every string went through
    ``redact_text``; its keys (metric names) and numbers as they are."""
    if isinstance(tree, Mapping):
        return {key: redact_strings(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact_strings(item) for item in tree]
    return redact_text(tree) if isinstance(tree, str) else tree


def _masked(tree: Any) -> Any:
    """``tree`` with its structure kept and every value in it masked."""
    if isinstance(tree, Mapping):
        return {key: _masked(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_masked(item) for item in tree]
    return tree if tree is None or tree == "" else MASK


class RedactFilter(logging.Filter):
    """On a handler: the formatted message of every record it emits (and its traceback) redacted.

    The record is rewritten in place, so the other handlers of the same record see the redacted
    text too: a secret that reaches any log line reaches none of them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = _escaped_lines(redact_text(message), one_line=record.name.partition(".")[0] == "trainforge")
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _escaped_lines(redact_text(record.exc_text), one_line=False)
        return True


def _escaped_lines(text: str, one_line: bool) -> str:
    """No terminal escape or other control character reaches a log (errors.printable): trainforge's
    own lines stay one line; another library's message and a traceback keep their line breaks."""
    if one_line:
        return printable(text)
    return "\n".join(printable(line) for line in text.split("\n"))


def redacting(handler: logging.Handler) -> logging.Handler:
    """``handler`` with a ``RedactFilter`` (once); returns it for chaining."""
    if not any(isinstance(f, RedactFilter) for f in handler.filters):
        handler.addFilter(RedactFilter())
    return handler


def install_on_logger(name: str = "trainforge") -> None:
    """A ``RedactFilter`` on the logger ``name`` itself: its records are redacted before any
    handler (the console's, a run's file, pytest's capture) sees them. Idempotent."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactFilter) for f in logger.filters):
        logger.addFilter(RedactFilter())


mask_messages_with(redact_text)  # every TrainforgeError's text, as it is made (errors.TrainforgeError)
