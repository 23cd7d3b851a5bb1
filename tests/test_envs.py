"""The main environment (.venv): a second clone beside this one gets its own causalkv over the
same cached layer, and deleting it breaks nothing here (tests/env_isolation.py)."""

from env_isolation import check_two_clones


def test_two_clones_each_import_their_own_causalkv_in_the_main_environment(tmp_path):
    check_two_clones("main", tmp_path)
