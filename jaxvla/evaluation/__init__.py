"""Evaluation: success over fixed-seed episodes (success.py), a policy export evaluated and
recorded on its own (exported.py). The command, with openpi's LIBERO protocol and the
tables, is jaxvla/eval.py."""
