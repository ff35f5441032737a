"""The package stands alone: installed (not the checkout), it trains from a user's config
file, then evaluates and serves the export, from a directory outside the checkout."""

import os
import subprocess
import sys
import textwrap

import openpi_client.websocket_client_policy as openpi_client
import pytest

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A user's own config: the package's defaults, shrunk to a minute on a CPU.
USER_CONFIG = textwrap.dedent("""\
    from jaxvla import defaults

    def get_config():
      c = defaults.get_config()
      c.total_env_steps, c.num_envs, c.rollout_len = 320, 8, 4
      c.bc.num_episodes, c.bc.num_steps, c.bc.batch_size = 8, 5, 16
      c.eval.num_episodes, c.eval.every_iters = 8, 100
      c.log.progress = False
      return c
    """)


def _run(argv, env, cwd, timeout=600):
  r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                     check=False)
  assert r.returncode == 0, f"{argv}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  return r


@pytest.mark.run_first(6)
@pytest.mark.slow  # A pip build, a short run, an evaluation and a server: about two minutes.
def test_installed_jaxvla_trains_evaluates_and_serves_outside_the_checkout(tmp_path):
  site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
  elsewhere.mkdir()
  # The package as pip installs it (a wheel's files, no configs/ beside it), first on the
  # path so that it, not the checkout's editable install, is what runs.
  _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        "--target", str(site), ROOT], dict(os.environ), str(tmp_path))
  env = conftest.fast_xla_env(dict(os.environ, PYTHONPATH=str(site)))  # (short runs)
  where = _run([sys.executable, "-c", "import jaxvla; print(jaxvla.__file__)"], env,
               str(elsewhere)).stdout.strip()
  assert where.startswith(str(site)), where
  assert not (site / "configs").exists()

  (elsewhere / "my_config.py").write_text(USER_CONFIG)
  _run([sys.executable, "-m", "jaxvla.main", "--config=my_config.py", "--workdir=run"], env,
       str(elsewhere))
  export = elsewhere / "run" / "export"
  assert (export / "config.json").exists()

  _run([sys.executable, "-m", "jaxvla.eval", f"--policy={export}", "--episodes_per_task=4",
        "--videos_per_task=0", "--out=eval"], env, str(elsewhere))
  assert (elsewhere / "eval" / "results.json").exists()

  log_path = tmp_path / "serve.log"
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxvla.serve", f"--policy={export}", "--port=0",
         "--host=127.0.0.1", "--serve.warmup=False"],
        cwd=str(elsewhere), env=env, stdout=subprocess.PIPE, stderr=log, text=True)
  try:
    line = proc.stdout.readline()
    assert "on port" in line, (line, log_path.read_text()[-3000:])
    client = openpi_client.WebsocketClientPolicy("127.0.0.1",
                                                 int(line.split("on port ")[1].split()[0]))
    meta = client.get_server_metadata()
    assert client.infer(meta["example_observation"])["actions"].ndim == 2
  finally:
    proc.kill()
    proc.wait()
