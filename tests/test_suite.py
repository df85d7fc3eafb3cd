"""The suite's own machinery: the property tests' profiles, the mark that sends a test to the process phase and
the worker it runs on there, the template database every test process and stack is copied from."""

import os
import subprocess
import sys

import hypothesis

from harness import databases
from tests.helpers import BASE_DIR, EXAMPLES_CI, EXAMPLES_FULL, examples

# The nested pytest runs read their own output: the options a whole run was given (PYTEST_ADDOPTS="-v" turned
# --collect-only -q's list into a tree, and the marking test failed) are not theirs.
OWN_OPTIONS = {**os.environ, "PYTEST_ADDOPTS": ""}


def test_property_tests_draw_a_quarter_of_their_examples_in_ci_and_all_of_them_in_full():
    loaded = hypothesis.settings.get_current_profile_name()
    try:
        hypothesis.settings.load_profile("ci")
        assert hypothesis.settings.default.max_examples == EXAMPLES_CI
        assert (examples(400), examples(100), examples(8)) == (100, 25, 10)  # never fewer than 10
        hypothesis.settings.load_profile("full")
        assert hypothesis.settings.default.max_examples == EXAMPLES_FULL
        assert (examples(400), examples(100)) == (400, 100)
    finally:
        hypothesis.settings.load_profile(loaded)


def test_what_starts_a_process_is_marked_for_the_process_phase():
    """Marked from the fixtures a test uses, its folder and its module's code: a node, a stack, a live server, a
    browser, a server of its own; a policy test, a page rendered in-process, a linter run to its end are not."""
    tests = {
        "tests/workers/test_node_agent.py::test_health_status_and_metrics": True,  # a node
        "tests/recovery/gateway/test_gateway.py::test_keys_unknown_models_and_no_nodes": True,  # a gateway cluster
        "tests/e2e/test_e2e.py::test_gateway_serves_through_the_demo": True,  # the demo stack
        "tests/browser/test_slo_detail_browser.py": True,  # Chromium
        "tests/console/test_web_processes.py": True,  # web processes of its own
        "tests/e2e/test_chaos_e2e.py": True,  # a stack, through the chaos benchmark's command
        "tests/test_code_checks.py": False,  # linters, run to their end
        "tests/recovery/policy/test_policies.py::test_pending_counts_dispatches_and_never_goes_below_zero": False,
        "tests/console/test_slo_pages.py::test_every_role_reads_the_page_with_real_numbers": False,  # a page
    }
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "processes"]
    listed = subprocess.run(
        [*argv, *tests], cwd=BASE_DIR, env=OWN_OPTIONS, capture_output=True, text=True, check=True
    ).stdout
    marked = {test: any(line.startswith(test) for line in listed.splitlines()) for test in tests}
    assert marked == tests, listed


def test_a_copy_of_the_template_has_every_table_and_no_row_written_since(django_db_blocker):
    """Each test process's database and each stack's is a copy of the run's template, migrated once."""
    import os

    import psycopg

    from console import env
    from tests.conftest import template_database

    template = template_database()
    with django_db_blocker.unblock(), databases.scratch("lifeline_suite", template) as url:
        params = env.database_from_url(url)
        with psycopg.connect(
            host=params["HOST"], port=params["PORT"], user=params["USER"] or None, dbname=params["NAME"]
        ) as connection:
            tables = {row[0] for row in connection.execute("SELECT tablename FROM pg_tables WHERE schemaname='public'")}
            applied = connection.execute("SELECT count(*) FROM django_migrations").fetchone()[0]
            nodes = connection.execute("SELECT count(*) FROM recovery_node").fetchone()[0]
    assert {"recovery_node", "recovery_incident", "django_migrations", "auth_user"} <= tables
    assert applied > 0 and nodes == 0
    assert os.environ["DATABASE_URL"].startswith("postgres")  # PostgreSQL everywhere, embedded or not


def test_stacks_and_browsers_share_one_worker_and_every_other_module_keeps_to_one():
    """The process phase runs on two xdist workers (`--dist loadgroup`, scheduled by tests/conftest.py): what starts
    a whole stack or drives the browser is one scope, "stacks", run one test after another on one worker; any other
    module, a real engine's included, is a scope of its own."""
    from tests.conftest import ByProcessGroup

    expected = {
        "tests/e2e/test_e2e.py::test_gateway_serves_through_the_demo": "stacks",  # the demo stack
        "tests/e2e/test_operations_e2e.py::test_x": "stacks",  # a stack, driven in Chromium
        "tests/browser/test_slo_detail_browser.py::test_the_manager_opens_an_objective": "stacks",  # Chromium
        "tests/console/test_experiments_browser.py::test_x": "stacks",  # Chromium
        "tests/console/test_web_processes.py::test_x": "stacks",  # a database and web processes of its own
        "tests/recovery/gateway/test_vllm_engine.py::test_x": "tests/recovery/gateway/test_vllm_engine.py",  # vLLM
        "tests/workers/test_real_engine.py::test_x[a]": "tests/workers/test_real_engine.py",  # llama-server
        "tests/workers/test_node_agent.py::test_health_status_and_metrics": "tests/workers/test_node_agent.py",
        "tests/recovery/gateway/test_gateway.py::test_keys[x]": "tests/recovery/gateway/test_gateway.py",
    }
    assert {nodeid: ByProcessGroup._split_scope(None, nodeid) for nodeid in expected} == expected


# Where each test of a run went, one line per test: "<worker> <node id>".
WHERE = """
import os

def pytest_runtest_setup(item):
    with open(os.environ["LIFELINE_WHERE_FILE"], "a") as out:
        out.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {item.nodeid}\\n")
"""


def test_the_process_phase_sends_a_stacks_modules_to_one_worker(tmp_path):
    """A real run on two workers (fixtures planned, not run): the two stack modules' tests all go to one worker, the
    other module's to whichever is free."""
    (tmp_path / "where_plugin.py").write_text(WHERE)
    where = tmp_path / "where.txt"
    tests = ["tests/e2e/test_e2e.py", "tests/e2e/test_bad_requests_e2e.py", "tests/workers/test_node_agent.py"]
    env = {**OWN_OPTIONS, "PYTHONPATH": str(tmp_path), "LIFELINE_WHERE_FILE": str(where)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "where_plugin", "-p", "no:cacheprovider", "--setup-plan"]
    run = subprocess.run(
        [*argv, "-n", "2", "--dist", "loadgroup", *tests], cwd=BASE_DIR, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-3000:]
    workers = {}
    for line in where.read_text().splitlines():
        worker, nodeid = line.split(" ", 1)
        workers.setdefault(nodeid.split("::")[0], set()).add(worker)
    assert set(workers) == set(tests), workers
    assert len(workers[tests[0]] | workers[tests[1]]) == 1, workers  # the stacks' scope: one worker


# The order a run will take, one line per test: "<node id> <takes demo_stack> <marked adds_nodes>".
ORDER = """
import os

def pytest_collection_finish(session):
    with open(os.environ["LIFELINE_ORDER_FILE"], "w") as out:
        for item in session.items:
            shared, adds = "demo_stack" in item.fixturenames, item.get_closest_marker("adds_nodes") is not None
            out.write(f"{item.nodeid} {int(shared)} {int(adds)}\\n")
"""


def test_the_shared_stacks_tests_run_last_together_and_those_adding_nodes_after_the_rest(tmp_path):
    """The shared stack (tests/conftest.py SharedStack) is started once and stopped after its last test only if its
    tests run one after another: ModuleOrder puts them last, those that register nodes of their own after those that
    count its nodes, and a module's tests that start a stack of their own before them; the real engines' modules
    after them all."""
    (tmp_path / "order_plugin.py").write_text(ORDER)
    order = tmp_path / "order.txt"
    tests = [
        "tests/browser/test_fleet_browser.py",  # shared, adds nodes
        "tests/browser/test_browser.py",  # shared, counts three tiles
        "tests/e2e/test_e2e.py",  # shared, and two tests with stacks of their own
        "tests/e2e/test_operations_e2e.py",  # a stack of its own, in Chromium
        "tests/workers/test_node_agent.py",  # nodes only
        "tests/e2e/test_real_engine_e2e.py",  # shared, adds a real engine
        "tests/workers/test_real_engine.py",  # a real engine, no stack
    ]
    env = {**OWN_OPTIONS, "PYTHONPATH": str(tmp_path), "LIFELINE_ORDER_FILE": str(order)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "order_plugin", "-p", "no:cacheprovider", "--collect-only"]
    run = subprocess.run([*argv, *tests], cwd=BASE_DIR, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
    rows = [line.split(" ") for line in order.read_text().splitlines()]
    # Last, the real engines' tests that need no stack: on a first run their build has the whole run to finish.
    engines = [row for row in rows if row[0].startswith(tests[-1])]
    assert engines and rows[-len(engines) :] == engines, rows
    rows = rows[: -len(engines)]
    shared = [(int(uses), int(adds)) for _, uses, adds in rows]
    first = next(i for i, (uses, _) in enumerate(shared) if uses)
    assert all(uses for uses, _ in shared[first:]), rows  # one block, at the end
    assert [adds for _, adds in shared[first:]] == sorted(adds for _, adds in shared[first:]), rows
    assert {nodeid.split("::")[0] for nodeid, uses, _ in rows[first:]} == {*tests[:3], tests[5]}
    assert rows[-1][0].startswith(tests[5]), rows  # the real engine on the shared stack: the last of its block
    own = [nodeid for nodeid, uses, _ in rows[:first] if nodeid.startswith(tests[2])]
    assert len(own) == 2, rows  # test_e2e's own stacks: before the shared one starts
