"""A weight-map entry's `stored` step (runtime/formats/scheme.py StoredEntry) as the loader and placement read it:
which released tensors hold the codes and the scale, and which runtime tensor and rows each fills."""
from __future__ import annotations

from pydantic import ValidationError

from runtime.errors import StoredUnsupported
from runtime.formats.scheme import MXFP4, StoredEntry, StoredFormat


def stored_entry(entry: dict) -> StoredEntry | None:
    """The weight-map entry's stored step, validated; None for a weight kept unquantized."""
    if entry.get("stored") is None:
        return None
    try:
        return StoredEntry.model_validate(entry["stored"])
    except ValidationError as err:
        raise ValueError(f"weight map entry for {entry['target']}: malformed stored step ({err.errors()[0]['msg']})") from None


def stored_parts(entry: dict) -> list[tuple[str, dict]]:
    """(released tensor, its entry) for the codes and the scale of a stored weight-map entry: the entry's steps with
    target `<target>.codes` / `<target>.scale` and its logical rows in rows of that tensor (FP8 scale rows are block
    rows: a row range must start on a block), plus `stored` (the StoredEntry) and `role`."""
    stored = stored_entry(entry)
    parts = []
    for role, released in (("codes", stored.codes), ("scale", stored.scale)):
        parts.append((released, entry | {"target": f"{entry['target']}.{role}", "stored": stored, "role": role,
                                          "rows": _role_rows(entry["rows"], stored.format, role, entry["target"])}))
    return parts


def _role_rows(rows: list[int] | None, fmt: StoredFormat, role: str, target: str) -> list[int] | None:
    if rows is None or role == "codes" or isinstance(fmt, MXFP4):
        return rows
    block = fmt.block[0]
    if rows[0] % block:
        raise StoredUnsupported(f"{target}: rows {rows} do not start on a {block}-row scale block")
    return [rows[0] // block, -(-rows[1] // block)]
