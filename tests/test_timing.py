"""StageClock busy/idle accounting and counters, the staleness Histogram, the timeline plot."""

import json
import threading
import time

import numpy as np
import pytest

from jaxvla import plot_timeline, timing

STAGES = ("env", "inference", "learner", "broadcast")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class FakeClock:
  """A clock the test moves by hand."""

  def __init__(self, t: float = 100.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


def _started(keep_intervals: int = 100_000, t: float = 100.0):
  fake = FakeClock(t)
  clock = timing.StageClock(STAGES, keep_intervals=keep_intervals, clock=fake)
  clock.start()
  return clock, fake


def _run_threads(work, n: int) -> None:
  """Runs ``work(i)`` for ``i < n`` in ``n`` threads; each must end within 30 s."""
  threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
    assert not t.is_alive()


def _union_length(intervals, lo=-np.inf, hi=np.inf) -> float:
  """Brute-force reference: sort, clip, merge."""
  total, cur_s, cur_e = 0.0, None, None
  for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
    if e <= s:
      continue
    if cur_e is None or s > cur_e:
      total += 0.0 if cur_e is None else cur_e - cur_s
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  return total + (0.0 if cur_e is None else cur_e - cur_s)


def test_overlapping_intervals_of_one_stage_count_once():
  clock, fake = _started()
  clock.add("env", 101.0, 104.0)  # Clock readings: t0 = 100.
  clock.add("env", 102.0, 106.0)  # Overlaps the first: union [1, 6) on the timeline.
  clock.add("env", 106.0, 107.0)  # Touches it: [1, 7).
  clock.add("learner", 102.0, 103.0)
  fake.t = 110.0
  busy = clock.busy_seconds()
  assert busy["env"] == pytest.approx(6.0)
  assert busy["learner"] == pytest.approx(1.0)
  assert busy["inference"] == busy["broadcast"] == 0.0
  f = clock.fractions()
  assert f["env_busy"] == pytest.approx(0.6) and f["env_idle"] == pytest.approx(0.4)
  assert f["inference_busy"] == 0.0 and f["inference_idle"] == 1.0
  assert set(f) == {f"{s}_{k}" for s in STAGES for k in ("busy", "idle")}


def test_fractions_with_fake_clock_count_open_blocks():
  clock, fake = _started(t=0.0)
  fake.t = 1.0
  with clock.busy("env"):
    fake.t = 3.0
  clock.add("env", 2.0, 5.0)  # Union with the block: [1, 5).
  fake.t = 8.0
  with clock.busy("learner"):
    fake.t = 10.0
    f = clock.fractions()  # The open learner block counts up to now.
    assert f["learner_busy"] == pytest.approx(0.2)
  assert f["env_busy"] == pytest.approx(0.4)
  fake.t = 20.0
  f = clock.fractions()
  assert f["env_busy"] == pytest.approx(0.2) and f["learner_busy"] == pytest.approx(0.1)
  # An explicit ``now`` is a timeline position: busy time after it does not count.
  assert clock.fractions(now=4.0)["env_busy"] == pytest.approx(3.0 / 4.0)
  assert clock.elapsed() == pytest.approx(20.0)


def test_window_covers_only_since_to_now():
  clock, fake = _started(t=50.0)  # Timeline positions are seconds since 50.
  clock.add("env", 51.0, 55.0)
  clock.add("learner", 54.0, 58.0)
  fake.t = 60.0
  w = clock.window(since=4.0)  # [4, 10]: env busy [4, 5), learner [4, 8).
  assert w["env_busy"] == pytest.approx(1 / 6) and w["env_idle"] == pytest.approx(5 / 6)
  assert w["learner_busy"] == pytest.approx(4 / 6)
  assert clock.window(since=8.0)["learner_busy"] == 0.0
  assert clock.window(since=2.0, now=3.0)["env_busy"] == pytest.approx(1.0)
  assert clock.window(since=0.0) == clock.fractions()
  empty = clock.window(since=10.0)
  assert empty["env_busy"] == 0.0 and empty["env_idle"] == 1.0


def test_concurrent_threads_lose_no_intervals():
  clock = timing.StageClock(STAGES)
  clock.start()
  n_threads, n_each = 8, 1000
  barrier = threading.Barrier(n_threads)

  def work(i: int) -> None:
    barrier.wait()
    stage = STAGES[i % 2]
    for _ in range(n_each):
      with clock.busy(stage):
        pass

  _run_threads(work, n_threads)
  ivs = clock.intervals()
  assert len(ivs["env"]) == len(ivs["inference"]) == n_threads // 2 * n_each
  assert clock.recorded() == {"env": 4000, "inference": 4000, "learner": 0, "broadcast": 0}
  busy = clock.busy_seconds()
  for s in ("env", "inference"):
    assert busy[s] == pytest.approx(_union_length(ivs[s]), rel=1e-6, abs=1e-9)
    assert busy[s] <= clock.elapsed()
  assert all(0.0 <= v <= 1.0 for v in clock.fractions().values())


def test_many_intervals_totals_stay_exact_when_record_is_trimmed():
  """10^5 intervals from 4 interleaved 'workers': exact totals, bounded record, exact window."""
  rng = np.random.default_rng(0)
  clock, fake = _started(keep_intervals=1000, t=0.0)
  # Each worker alternates busy (exp. 1 ms) and idle (exp. 3 ms); record at end time.
  per_worker = []
  for _ in range(4):
    lengths = rng.exponential(1e-3, 25_000)
    gaps = rng.exponential(3e-3, 25_000)
    starts = np.cumsum(gaps + np.concatenate([[0.0], lengths[:-1]]))
    per_worker.append(np.stack([starts, starts + lengths], 1))
  all_ivs = np.concatenate(per_worker)
  for s, e in all_ivs[np.argsort(all_ivs[:, 1])]:
    clock.add("env", float(s), float(e))
  end = float(all_ivs[:, 1].max())
  fake.t = end
  assert clock.busy_seconds()["env"] == pytest.approx(_union_length(all_ivs.tolist()), rel=1e-9)
  ivs = clock.intervals()["env"]
  assert len(ivs) == 1000 and clock.recorded()["env"] == 100_000
  assert ivs[-1][1] == pytest.approx(end)  # The newest are kept.
  since = end - 1.0  # A recent window, well inside what the union keeps.
  expected = _union_length(all_ivs.tolist(), lo=since, hi=end) / 1.0
  assert clock.window(since)["env_busy"] == pytest.approx(expected, rel=1e-9)


def test_open_block_is_exact_across_many_records():
  """A long busy() block stays exact while many short intervals of its stage arrive."""
  clock, fake = _started(keep_intervals=10, t=0.0)
  fake.t = 1.0
  with clock.busy("env"):
    for i in range(10_000):  # More disjoint pieces than the union keeps, all after 1.0.
      clock.add("env", 2.0 + i, 2.5 + i)
    fake.t = 20_000.0
  clock.add("env", 0.5, 1.5)
  assert clock.busy_seconds()["env"] == pytest.approx(20_000.0 - 0.5)


def test_unknown_stage_and_misuse():
  clock, _ = _started()
  with pytest.raises(ValueError, match=r"'wait_env'.*'env', 'inference', 'learner', 'broadcast'"):
    with clock.busy("wait_env"):
      pass
  with pytest.raises(ValueError, match="unknown stage 'nope'"):
    clock.add("nope", 100.0, 101.0)
  with pytest.raises(ValueError, match="ends before it starts"):
    clock.add("env", 101.0, 100.0)
  with pytest.raises(RuntimeError, match="start"):
    timing.StageClock(STAGES).add("env", 0.0, 1.0)
  with pytest.raises(ValueError, match="duplicate"):
    timing.StageClock(("env", "env"))


def test_counters_add_and_copy():
  clock, _ = _started()
  assert clock.counters() == {}
  clock.count("queue_wait_s", 0.5)
  clock.count("queue_wait_s", 0.25)
  clock.count("dropped", 3)  # Free-form names, not only the stages.
  got = clock.counters()
  assert got == {"queue_wait_s": 0.75, "dropped": 3.0}
  got["queue_wait_s"] = 99.0  # A copy: the clock's counters are unchanged.
  assert clock.counters()["queue_wait_s"] == 0.75
  clock.start()  # A new run starts from zero.
  assert clock.counters() == {}


def test_timed_adds_block_time_even_on_error():
  fake = FakeClock(5.0)
  clock = timing.StageClock(STAGES, clock=fake)  # Counters need no start().
  with clock.timed("pace_wait_s"):
    fake.t = 7.5
  with clock.timed("pace_wait_s"):
    fake.t = 8.0
  assert clock.counters() == {"pace_wait_s": pytest.approx(3.0)}
  with pytest.raises(KeyError):
    with clock.timed("recv_wait_s"):
      fake.t = 9.0
      raise KeyError("boom")
  assert clock.counters()["recv_wait_s"] == pytest.approx(1.0)


def test_timed_with_real_clock_measures_elapsed_time():
  clock = timing.StageClock(STAGES)
  t0 = time.perf_counter()
  with clock.timed("sleep_s"):
    time.sleep(0.05)
  wall = time.perf_counter() - t0
  assert 0.05 <= clock.counters()["sleep_s"] <= wall


def test_counters_threads_lose_no_additions():
  # Each thread reads a clock of its own that ticks 1.0 a call, so every timed block adds
  # exactly 1.0 whatever the threads' interleaving: a lost addition shows in the sum.
  ticks = threading.local()

  def tick() -> float:
    ticks.t = getattr(ticks, "t", 0.0) + 1.0
    return ticks.t

  clock = timing.StageClock(STAGES, clock=tick)
  n_threads, n_each = 8, 2000
  barrier = threading.Barrier(n_threads)

  def work(i: int) -> None:
    barrier.wait()
    for _ in range(n_each):
      clock.count("shared", 1.0)
      clock.count(f"own_{i % 2}", 0.5)
      with clock.timed("timed_s"):
        pass

  _run_threads(work, n_threads)
  got = clock.counters()
  assert got["shared"] == n_threads * n_each
  assert got["own_0"] == got["own_1"] == n_threads // 2 * n_each * 0.5
  assert got["timed_s"] == n_threads * n_each


def test_histogram_summary_and_ge16_bucket():
  h = timing.Histogram()
  assert h.summary("staleness") == {}
  h.add(np.array([0, 0, 1, 2]))
  h.add([1], count_weights=[4])
  assert h.counts() == {0: 2, 1: 5, 2: 1}
  s = h.summary("staleness")
  assert s == pytest.approx({"staleness_mean": 7 / 8, "staleness_max": 2.0, "staleness_0": 2 / 8,
                             "staleness_1": 5 / 8, "staleness_2": 1 / 8})
  h.add([16, 20, 3])
  s = h.summary("st")
  assert s["st_max"] == 20.0
  assert s["st_mean"] == pytest.approx((7 + 16 + 20 + 3) / 11)
  assert s["st_ge16"] == pytest.approx(2 / 11)
  assert s["st_15"] == 0.0 and "st_16" not in s and "st_20" not in s
  assert sum(v for k, v in s.items() if k not in ("st_mean", "st_max")) == pytest.approx(1.0)
  with pytest.raises(ValueError):
    h.add([-1])
  with pytest.raises(TypeError):
    h.add([0.5])
  h.reset()
  assert h.counts() == {}


def test_histogram_threads():
  h = timing.Histogram()
  _run_threads(lambda i: [h.add([1, 2]) for _ in range(500)], 4)
  assert h.counts() == {1: 2000, 2: 2000}


def test_marks_give_busy_fractions_between_marks():
  """Two workers' summed busy seconds, marked after each update."""
  marks = timing.Marks(capacity=2)
  marks.add(10.0, 4.0)  # (update 1: 4 worker-seconds in the first 10 s)
  marks.add(20.0, 19.0)  # (update 2: 15 more in the next 10)
  assert marks.fraction(0.0, 10.0, now=(30.0, 30.0)) == pytest.approx(4.0 / 20)
  assert marks.fraction(10.0, 20.0, now=(30.0, 30.0)) == pytest.approx(15.0 / 20)
  # Since a time between marks: from the mark before it; no end: to the reading now.
  assert marks.fraction(15.0, None, now=(30.0, 29.0)) == pytest.approx((29 - 4) / 40)
  assert marks.fraction(12.0, 15.0, now=(30.0, 29.0)) == 0.0  # (one mark: no span)


def test_json_round_trip(tmp_path):
  clock, fake = _started(t=10.0)
  clock.add("env", 11.0, 12.5)
  clock.add("env", 12.0, 13.0)
  clock.add("broadcast", 14.0, 14.25)
  clock.count("pace_wait_s", 0.5)
  fake.t = 20.0
  path = str(tmp_path / "run" / "timeline.json")
  clock.to_json(path)
  loaded = timing.StageClock.from_json(path)
  assert loaded == clock.intervals()
  assert loaded["env"] == [(1.0, 2.5), (2.0, 3.0)] and loaded["learner"] == []
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  assert record["elapsed_s"] == pytest.approx(10.0)
  assert record["busy_seconds"]["env"] == pytest.approx(2.0)
  assert record["counters"] == {"pace_wait_s": 0.5}
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  with pytest.raises(ValueError, match="not a StageClock timeline"):
    timing.StageClock.from_json(str(bad))


def test_plot_timeline_writes_png(tmp_path):
  ivs = {"env": [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], "inference": [(2.0, 2.5)],
         "learner": [(1.0, 5.0)], "broadcast": []}
  out = str(tmp_path / "plots" / "timeline.png")
  assert plot_timeline.plot_timeline(ivs, out, title="test") == out
  with open(out, "rb") as f:
    data = f.read()
  assert len(data) > 1000 and data.startswith(PNG_SIGNATURE)
  windowed = str(tmp_path / "window.png")
  plot_timeline.plot_timeline(ivs, windowed, t_range=(1.0, 4.0))
  with open(windowed, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE
