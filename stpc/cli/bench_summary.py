"""The summary at the top of benchmarks/RESULTS.md: each bench section's headline, copied
out of the section itself.

``python -m stpc bench summary --results FILE`` writes it between ``<!-- bench:summary -->``
markers, and every bench that writes its own section into a file with those markers writes
the summary again (``stpc.cli.bench.write_section``): the summary cannot disagree with the
sections below it, and no figure in it is typed by hand. Each section's headline is the
sentence its bench prints for the verdict (the targets met or missed, the geo-mean
speedups and the win / tie / loss counts, the search times against PrimePar's, the kernel's
geo-mean), with the date and machine of the run that wrote it.
"""
from __future__ import annotations

import re

# the sections the benches write (and ``benchmarks/dp_gap_check.py``'s), in the order the
# summary lists them
SECTIONS = ("fidelity", "runtime", "dp-gap", "primepar", "planner", "kernel")

_NOT_FOUND = "(no headline found in this section: its bench changed what it writes; read the section)"


def markers(name: str) -> tuple[str, str]:
    """The comments that open and close section ``name`` of a results file."""
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def section_text(doc: str, name: str) -> str | None:
    """The body of ``doc``'s ``name`` section (between its markers), or None."""
    start, end = markers(name)
    if start not in doc or end not in doc:
        return None
    return doc.split(start, 1)[1].split(end, 1)[0]


def _lines(text: str, prefix: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.startswith(prefix)]


def _fidelity(text: str) -> list[str]:
    out = [line.split("; measurement ties", 1)[0] + "." for line in _lines(text, "Targets:")]
    tau = re.search(r"Kendall's tau-b (-?[0-9.]+)", text)
    if out and tau:
        out[0] = out[0][:-1] + f" (Kendall's tau-b over all plans {tau.group(1)})."
    return out


def _runtime(text: str) -> list[str]:
    return _lines(text, "Targets met")


def _dp_gap(text: str) -> list[str]:
    return _lines(text, "Taken apart:")


def _counts(line: str) -> str:
    """A primepar verdict line with its lists of cells left out: the three counts alone."""
    found = re.findall(r"stpc (wins|ties|loses) \(([^)]*)\) in (\d+)", line)
    return "; ".join(f"stpc {what} ({band}) in {n}" for what, band, n in found) + " cells" if found else ""


def _primepar(text: str) -> list[str]:
    out = []
    for part in re.split(r"^### ", text, flags=re.M)[1:]:
        title = part.splitlines()[0].strip()
        geo = _lines(part, "Geo-mean speedup at")
        counts = [c for c in map(_counts, _lines(part, "stpc wins")) if c]
        if geo or counts:
            out.append(f"{title}: " + " ".join(geo + [c + "." for c in counts]))
        out += [f"{title}: {line}" for line in _lines(part, "Under the model, PrimePar's")]
    return out


def _planner(text: str) -> list[str]:
    return _lines(text, "Median search")


def _kernel(text: str) -> list[str]:
    device = [line.split(". ", 1)[0] + ":" for line in _lines(text, "NVIDIA")][:1]
    found = _lines(text, "Geo-mean Triton speedup") or _lines(text, "**Not measured")
    return [" ".join(device + found[:1])] + found[1:] if found else []


_HEADLINES = {"fidelity": _fidelity, "runtime": _runtime, "dp-gap": _dp_gap, "primepar": _primepar, "planner": _planner,
              "kernel": _kernel}


def headlines(name: str, text: str) -> list[str]:
    """The headline sentences of bench ``name``'s section ``text``."""
    return _HEADLINES[name](text)


def _title_and_run(text: str) -> tuple[str, str]:
    title = next((line[3:].strip() for line in text.splitlines() if line.startswith("## ")), "")
    machine = next((line for line in text.splitlines() if line.startswith("machine: ")), "")
    where, _, when = machine[len("machine: "):].partition("; ")
    return title, f"{when.split(';')[0]}, {where}" if machine else "machine not recorded"


def summary(doc: str) -> str:
    """The summary section's text for the markdown ``doc``: one entry per bench section present."""
    out = ["## Where stpc stands", "",
           "Each entry is the headline of a section below, copied out of it by `python -m stpc bench summary` "
           "(which every bench runs again after writing its own section): the run's date and machine, then "
           "its verdict as the section states it. Modelled figures say modelled; the sections hold the "
           "commands, the raw numbers and why.", ""]
    for name in SECTIONS:
        text = section_text(doc, name)
        if text is None:
            continue
        title, run = _title_and_run(text)
        lines = headlines(name, text) or [_NOT_FOUND]
        out.append(f"- **{title or name}** ({run}):")
        out += [f"  - {line}" for line in lines]
    return "\n".join(out) + "\n"


__all__ = ["SECTIONS", "markers", "section_text", "headlines", "summary"]
