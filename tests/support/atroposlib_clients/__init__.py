"""atroposlib's own clients of the Atropos API (its example trainer, a BaseEnv), run as
scripts in processes of their own with atroposlib on PYTHONPATH: apart from
tests/support/atroposlib.py, whose name would hide the package from them."""
