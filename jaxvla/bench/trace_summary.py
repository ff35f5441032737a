"""Where the time goes in a ``jax.profiler`` trace of the pipeline.

``python -m jaxvla.bench.trace_summary DIR`` reads the newest trace under ``DIR``
(what ``jax.profiler.start_trace(DIR)`` wrote: ``plugins/profile/<run>/*.trace.json.gz``,
or that file itself) and prints, over the trace's span:

* **host stages**: the pipeline's own spans (``inference`` = act, ``learner``,
  ``env``, broadcast dispatch and wait), which :class:`jaxvla.timing.StageClock`
  and the weight broadcast mark with ``jax.profiler.TraceAnnotation`` under
  :data:`jaxvla.timing.TRACE_PREFIX`;
* **XLA program dispatch**: each jitted function's host-side execute calls
  (``PjitFunction(name)`` spans; asynchronous dispatch, so not its run time);
* **transfers, host calls**: the calls that put arrays on devices or bring them
  back (``device_to_host`` includes the wait for the result), and compiles
  inside the span (none in a steady state);
* **devices**: each device's busy fraction (the union of its kernels and
  copies; on the CPU backend, of the XLA ops its host threads ran, which carry
  their module and device), busy time per XLA module, memcpy time by direction,
  and its idle gaps, each labelled with the host stages that were running
  while the device waited.

Every time is the union of the intervals it names, so nested or overlapping
events (several threads in one stage) count once. ``--json`` prints the summary
as one JSON line instead of the tables.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
from typing import Iterable

from jaxvla import timing

Interval = tuple[float, float]

# Host events (names of this JAX version's TraceMe spans) that move arrays or compile,
# and what they count as.
HOST_CALLS = {
    "shard_args": "host_to_device", "DevicePutWithSharding": "host_to_device",
    "H2D Dispatch": "host_to_device",
    "ArrayImpl.copy_to_host_async": "device_to_host", "np.asarray(jax.Array)": "device_to_host",
    "batched_copy_array_to_devices_with_sharding": "device_to_device",
    "backend_compile_and_load": "compile", "lower_sharding_computation": "compile",
}
# Lines of a device's timeline that summarise others (not kernels or copies).
DERIVED_LINES = ("Steps", "XLA Modules", "XLA Ops", "Framework Name Scope",
                 "TensorFlow Name Scope", "Framework Ops", "TensorFlow Ops", "Launch Stats",
                 "Source code", "_counters_")
_PROGRAM = re.compile(r"^PjitFunction\((.*)\)$")
_MODULE_ID = re.compile(r"\(\d+\)$")


def find_trace(path: str) -> str:
  """The trace file ``path`` names: the file itself, or the newest under a log dir.

  Raises:
    FileNotFoundError: no ``*.trace.json.gz`` under ``path``.
  """
  if os.path.isfile(path):
    return path
  found = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {path!r} (a jax.profiler log dir)")
  return max(found, key=os.path.getmtime)


def load(path: str) -> list[dict]:
  """The trace events of the trace that ``path`` names (see :func:`find_trace`)."""
  path = find_trace(path)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  if not isinstance(events, list):
    raise ValueError(f"{path}: no traceEvents list")
  return events


def merge(intervals: Iterable[Interval]) -> list[Interval]:
  """The union of ``intervals`` as sorted, disjoint ``(start, end)`` pieces."""
  out: list[list[float]] = []
  for s, e in sorted(intervals):
    if out and s <= out[-1][1]:
      out[-1][1] = max(out[-1][1], e)
    else:
      out.append([s, e])
  return [(s, e) for s, e in out]


def length(pieces: Iterable[Interval]) -> float:
  return sum(e - s for s, e in pieces)


def gaps(pieces: list[Interval], lo: float, hi: float) -> list[Interval]:
  """The parts of ``[lo, hi)`` that merged ``pieces`` leave uncovered."""
  out, t = [], lo
  for s, e in pieces:
    if s > t:
      out.append((t, min(s, hi)))
    t = max(t, e)
    if t >= hi:
      break
  if t < hi:
    out.append((t, hi))
  return [(s, e) for s, e in out if e > s]


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
  """The intersection of two merged (sorted, disjoint) interval lists."""
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if s < e:
      out.append((s, e))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def _overlapping(pieces: list[Interval], lo: float, hi: float) -> bool:
  return any(s < hi and e > lo for s, e in pieces)


def _stat(intervals: list[Interval], window: float) -> dict:
  pieces = merge(intervals)
  busy = length(pieces)
  return dict(count=len(intervals), busy_s=busy, fraction=busy / window if window else 0.0,
              mean_ms=1e3 * sum(e - s for s, e in intervals) / max(1, len(intervals)))


def summarize(events: list[dict], min_gap_ms: float = 1.0, top_gaps: int = 5) -> dict:
  """What the trace's span was spent on; see the module docstring.

  Args:
    events: Chrome-trace events (``ph`` ``X`` spans in microseconds, ``M`` names).
    min_gap_ms: device idle gaps shorter than this are counted but not listed.
    top_gaps: how many of the longest gaps to list per device.

  Returns:
    ``window_s``, ``host_stages``, ``programs``, ``transfers`` (each name ->
    count, busy_s, fraction, mean_ms) and ``devices`` (device name -> busy
    fraction, ``modules``, ``memcpy``, ``idle_s``, ``gaps``, ``idle_while``).

  Raises:
    ValueError: the trace has no complete (``ph`` ``X``) events.
  """
  process_names, thread_names = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process_names[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      thread_names[(e["pid"], e.get("tid"))] = e["args"]["name"]
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  if not spans:
    raise ValueError("the trace has no complete ('X') events: was anything run while tracing?")
  lo = min(e["ts"] for e in spans) / 1e6
  hi = max(e["ts"] + e["dur"] for e in spans) / 1e6
  window = hi - lo

  def iv(e) -> Interval:
    return (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)

  device_pids = {pid for pid, name in process_names.items() if name.startswith("/device:")}
  stages, programs = collections.defaultdict(list), collections.defaultdict(list)
  transfers = collections.defaultdict(list)
  devices = collections.defaultdict(lambda: dict(
      busy=[], line_modules=collections.defaultdict(list),
      kernel_modules=collections.defaultdict(list), memcpy=collections.defaultdict(list)))
  for e in spans:
    name, args = e.get("name", ""), e.get("args") or {}
    if e["pid"] in device_pids:  # A GPU / TPU timeline: kernels, copies and derived lines.
      dev = devices[process_names[e["pid"]]]
      line = thread_names.get((e["pid"], e.get("tid")), "")
      if line == "XLA Modules":
        dev["line_modules"][_MODULE_ID.sub("", name)].append(iv(e))
      if line in DERIVED_LINES:
        continue
      dev["busy"].append(iv(e))
      if "memcpy" in name.lower():
        direction = next((d for d in ("H2D", "D2H", "D2D", "P2P") if d in name), "other")
        dev["memcpy"][direction].append(iv(e))
      elif "hlo_module" in args:
        dev["kernel_modules"][_MODULE_ID.sub("", str(args["hlo_module"]))].append(iv(e))
      continue
    if "hlo_module" in args and not device_pids and not name.startswith("end: "):
      # The CPU backend: its ops run on host threads, tagged with module and device.
      dev = devices[f"/host:CPU device {args.get('device_ordinal', '?')}"]
      dev["busy"].append(iv(e))
      dev["kernel_modules"][_MODULE_ID.sub("", str(args["hlo_module"]))].append(iv(e))
    elif name.startswith(timing.TRACE_PREFIX):
      stages[name[len(timing.TRACE_PREFIX):]].append(iv(e))
    elif (m := _PROGRAM.match(name)):
      programs[m.group(1)].append(iv(e))
    elif name in HOST_CALLS:
      transfers[HOST_CALLS[name]].append(iv(e))

  stage_pieces = {k: merge(v) for k, v in stages.items()}
  out_devices = {}
  for name, dev in sorted(devices.items()):
    busy = merge(dev["busy"])
    # Module time from the 'XLA Modules' line where the trace has one, else from kernels.
    modules = dev["line_modules"] or dev["kernel_modules"]
    idle = gaps(busy, lo, hi)
    # Per host stage, the device idle time while that stage ran (stages overlap:
    # the rollout thread and the learner run at once), and while none ran.
    idle_while = {k: length(intersect(idle, p)) for k, p in stage_pieces.items()}
    idle_while["(no stage)"] = length(idle) - length(
        intersect(idle, merge(iv for p in stage_pieces.values() for iv in p)))
    long_gaps = [g for g in idle if (g[1] - g[0]) * 1e3 >= min_gap_ms]
    listed = sorted(long_gaps, key=lambda g: g[0] - g[1])[:top_gaps]
    out_devices[name] = dict(
        busy_fraction=length(busy) / window if window else 0.0,
        modules={k: length(merge(v)) for k, v in sorted(modules.items())},
        memcpy={k: length(merge(v)) for k, v in sorted(dev["memcpy"].items())},
        idle_s=length(idle),
        gaps_over_min=len(long_gaps),
        gaps=[dict(start_s=s - lo, length_ms=1e3 * (e - s),
                   host_stages=sorted(k for k, p in stage_pieces.items()
                                      if _overlapping(p, s, e))) for s, e in listed],
        idle_while=dict(sorted(((k, v) for k, v in idle_while.items() if v > 0),
                               key=lambda kv: -kv[1])))
  return dict(window_s=window,
              host_stages={k: _stat(v, window) for k, v in sorted(stages.items())},
              programs=dict(sorted(((k, _stat(v, window)) for k, v in programs.items()),
                                   key=lambda kv: -kv[1]["busy_s"])),
              transfers={k: _stat(v, window) for k, v in sorted(transfers.items())},
              devices=out_devices)


def format_summary(summary: dict, max_programs: int = 12) -> str:
  """The summary as plain-text tables."""
  w = summary["window_s"]
  lines = [f"trace span {w:.3f} s"]

  def table(title: str, rows: dict, limit: int | None = None) -> None:
    lines.append(f"{title:<40}{'busy s':>9}{'of span':>9}{'count':>7}{'mean ms':>9}")
    for k, r in list(rows.items())[:limit]:
      lines.append(f"  {k[:38]:<38}{r['busy_s']:>9.3f}{r['fraction']:>9.2f}{r['count']:>7d}"
                   f"{r['mean_ms']:>9.2f}")
    if limit is not None and len(rows) > limit:
      lines.append(f"  ({len(rows) - limit} more programs)")

  table("host stage (jaxvla annotations)", summary["host_stages"])
  table("XLA program dispatch (host)", summary["programs"], max_programs)
  table("transfer / compile (host calls)", summary["transfers"])
  if not summary["devices"]:
    lines.append("no device activity in this trace")
  for name, d in summary["devices"].items():
    lines.append(f"{name}: busy {d['busy_fraction']:.2f} of the span, idle {d['idle_s']:.3f} s "
                 f"in {d['gaps_over_min']} gaps over the minimum")
    for k, v in sorted(d["modules"].items(), key=lambda kv: -kv[1]):
      lines.append(f"  module {k[:40]:<40}{v:>9.3f} s {v / w if w else 0:>6.2f}")
    for k, v in d["memcpy"].items():
      lines.append(f"  memcpy {k:<40}{v:>9.3f} s {v / w if w else 0:>6.2f}")
    for k, v in d["idle_while"].items():
      lines.append(f"  idle while host in {k[:27]:<27}{v:>9.3f} s {v / w if w else 0:>6.2f}")
    for g in d["gaps"]:
      lines.append(f"  gap at {g['start_s']:8.3f} s: {g['length_ms']:8.2f} ms, host in "
                   f"{','.join(g['host_stages']) or '(no stage)'}")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  args = [a for a in argv[1:] if a != "--json"]
  if len(args) != 1:
    print("usage: python -m jaxvla.bench.trace_summary TRACE_DIR_OR_FILE [--json]",
          file=sys.stderr)
    return 2
  summary = summarize(load(args[0]))
  print(json.dumps(summary) if "--json" in argv else format_summary(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
