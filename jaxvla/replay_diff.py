"""Where two runs part: ``python -m jaxvla.replay_diff A B``.

Reads the schedule logs (:mod:`jaxvla.runtime.schedule`) of two run workdirs (two
runs, or a run and its replay), session by session, and names the first update whose
inputs or outputs differ, and in what: the queue items it trained on, the items it
dropped as too stale, the policy versions that made its items, a metric of the
learner (loss, grad norm, KL, ...), exactly. Before any update differs, the first
rollout step that differs is named too (which envs, which version), since that is
where an asynchronous run's timing first made it another run.

Prints one line and, with ``--json``, a JSON object; exits 0 when the logs agree
and 1 when they differ.

  python -m jaxvla.replay_diff /tmp/run /tmp/run_replay
"""

from __future__ import annotations

import json
import sys
from typing import Any

from absl import app, flags

from jaxvla.runtime import schedule as schedule_lib


def _logs(workdir: str) -> list[schedule_lib.Session]:
  iterations = schedule_lib.sessions(workdir)
  if not iterations:
    raise FileNotFoundError(f"{workdir} holds no schedule log "
                            f"({schedule_lib.directory(workdir)}/session-*.jsonl)")
  return [schedule_lib.Session(schedule_lib.session_path(workdir, i)) for i in iterations]


def _first_step_difference(a: schedule_lib.Session, b: schedule_lib.Session
                           ) -> dict[str, Any] | None:
  for n, (x, y) in enumerate(zip(a.steps, b.steps)):
    x, y = x.to_json(), y.to_json()  # (compared by their fields as written)
    if x != y:
      keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
      return dict(step=n, what=keys, a={k: x.get(k) for k in keys},
                  b={k: y.get(k) for k in keys})
  return None


def _update_difference(x: schedule_lib.UpdateRecord, y: schedule_lib.UpdateRecord
                       ) -> dict[str, Any] | None:
  """The first field of two update records that differs: inputs first, then metrics."""
  for field in ("u", "items", "dropped"):
    a, b = getattr(x, field), getattr(y, field)
    if a != b:
      return dict(what=field, a=a if isinstance(a, int) else list(a),
                  b=b if isinstance(b, int) else list(b))
  mx, my = x.metrics, y.metrics
  for name in sorted(set(mx) | set(my)):
    if not schedule_lib.same_float(mx.get(name), my.get(name)):
      return dict(what=f"metrics.{name}", a=mx.get(name), b=my.get(name))
  return None


def compare(a_dir: str, b_dir: str) -> dict[str, Any]:
  """The first difference between the runs in ``a_dir`` and ``b_dir``.

  Returns:
    ``equal`` (bool), ``updates`` compared, and for a difference: ``session`` (its
    iteration), ``update`` (the update's index in the run: its policy version before
    it), ``what`` (``items``, ``dropped``, ``metrics.<name>``, ``sessions`` or
    ``length``), the two values, and ``first_step``: the first rollout step of that
    session that differs, if one does.
  """
  logs_a, logs_b = _logs(a_dir), _logs(b_dir)
  compared = 0
  for sa, sb in zip(logs_a, logs_b):
    if sa.iteration != sb.iteration:
      return dict(equal=False, updates=compared, what="sessions",
                  a=sa.iteration, b=sb.iteration)
    step = _first_step_difference(sa, sb)
    for x, y in zip(sa.updates, sb.updates):
      diff = _update_difference(x, y)
      if diff is not None:
        return dict(equal=False, updates=compared, session=sa.iteration, update=x.u,
                    first_step=step, **diff)
      compared += 1
    if len(sa.updates) != len(sb.updates):
      return dict(equal=False, updates=compared, session=sa.iteration, what="length",
                  a=len(sa.updates), b=len(sb.updates), first_step=step)
  if len(logs_a) != len(logs_b):
    return dict(equal=False, updates=compared, what="sessions",
                a=[s.iteration for s in logs_a], b=[s.iteration for s in logs_b])
  return dict(equal=True, updates=compared)


def describe(result: dict[str, Any]) -> str:
  """One line for :func:`compare`'s result."""
  if result["equal"]:
    return f"equal: {result['updates']} updates, their items, drops and metrics"
  what = result["what"]
  if what == "sessions":
    return (f"the runs' sessions differ (started at iterations {result['a']} and "
            f"{result['b']}), after {result['updates']} equal updates")
  where = f"session {result['session']}"
  if what == "length":
    line = (f"{where}: {result['a']} and {result['b']} updates; the first "
            f"{result['updates']} are equal")
  else:
    line = (f"first difference at update {result['update']} ({where}), in {what}: "
            f"{result['a']!r} against {result['b']!r}")
  step = result.get("first_step")
  if step is not None:
    line += (f"; the rollouts first differ at step {step['step']} "
             f"({', '.join(step['what'])}: {step['a']} against {step['b']})")
  return line


def _define_flags() -> None:
  flags.DEFINE_bool("json", False, "Also print the result as one JSON object.")


def main(argv: list[str]) -> None:
  if len(argv) != 3:
    raise app.UsageError("usage: python -m jaxvla.replay_diff RUN_A RUN_B (two workdirs)")
  result = compare(argv[1], argv[2])
  print(describe(result))
  if flags.FLAGS.json:
    print(json.dumps(result))
  sys.exit(0 if result["equal"] else 1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
