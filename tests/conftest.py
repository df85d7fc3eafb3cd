import contextlib
import functools
import os
import re
import signal
import sys
from pathlib import Path

import hypothesis
import pytest
from xdist.scheduler import LoadScopeScheduling

from harness.processes import BASE_DIR, DemoStack, demo, stack_env
from recovery.keys import Keys
from tests.gateway_cluster import Cluster
from tests.helpers import CHROMIUM_ARGS, EXAMPLES_CI, EXAMPLES_FULL, NodeProcess, chromium_path, pid_alive

ROLE_PASSWORD = "correct-horse-{}"

# Property tests draw a quarter of their examples in the suite (`ci`, the default) and all of them on demand:
# `./lifeline test --hypothesis-profile=full`. Tests that name a count say it through tests.helpers.examples().
hypothesis.settings.register_profile("ci", max_examples=EXAMPLES_CI)
hypothesis.settings.register_profile("full", max_examples=EXAMPLES_FULL)
hypothesis.settings.load_profile("ci")


BROWSER_FIXTURES = {"browser", "chromium"}
# What starts a process that stays up or serves on a socket: a node, a stack, a real engine, a live server, a
# browser. A test that uses one is marked `processes` and runs in the process phase of `./lifeline test`, one at a
# time (on two workers with LIFELINE_PROCESS_WORKERS=2, see process_group); the rest (a command run to its end, such
# as a linter, included) on every core.
PROCESS_FIXTURES = {"node_factory", "cluster", "demo_stack", "ops_stack", "live_server"}
PROCESS_WORDS = re.compile(
    r"\b(Popen|multiprocessing|ProcessPool\w*|NodeProcess|DemoStack|Supervisor|stack_database|LlamaServer|"
    r"real_engine|vllm_engine|AppRunner|TestServer|aiohttp_server|promtool)\b"
)
PROCESS_FOLDERS = ("tests/e2e/", "tests/browser/")
# What holds this machine's cores for seconds at a time: a whole stack, a browser. In the process phase these run one
# after another on one xdist worker (the group "stacks"), and the lighter modules (a few nodes, a gateway, a server,
# a real engine) beside them on the other, a module at a time. Two stacks at once are more than this 2-core machine
# holds: a run on three workers (the browser's stacks on one, the others on another) missed heartbeats for 4.6 s and
# timed out pages and an engine's reload. A real engine beside a stack is no more than the loaded runs' spinning
# process (green under it on the morning's host): the engines moved to the other worker on 2026-12-07, when the
# stacks' worker was the whole process phase (824 s of tests against 605). The modules that use the stack fixtures
# are those of PROCESS_FOLDERS; those that drive the browser take the `browser` fixture (BROWSER_ARGUMENT).
STACK_WORDS = re.compile(r"\bstack_database\b|[^\w.]demo\(")
BROWSER_ARGUMENT = re.compile(r"[(,]\s*browser\b")


def _starts_processes(module) -> bool:
    """Whether a test module's own code starts a process or a server (read once per module)."""
    found = getattr(module, "__starts_processes__", None)
    if found is None:
        path = Path(module.__file__)
        found = path.relative_to(BASE_DIR).as_posix().startswith(PROCESS_FOLDERS) or bool(
            PROCESS_WORDS.search(path.read_text())
        )
        module.__starts_processes__ = found
    return found


@functools.cache
def process_group(path: str) -> str:
    """The xdist group of a process-phase module (`path` relative to the checkout): "stacks" for one that starts a
    whole stack or drives Chromium (its folder or its own code says so), else the module itself."""
    text = (BASE_DIR / path).read_text()
    heavy = path.startswith(PROCESS_FOLDERS) or STACK_WORDS.search(text) or BROWSER_ARGUMENT.search(text)
    return "stacks" if heavy else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark what starts processes (before `-m` selects on the mark)."""
    for item in items:
        module = getattr(item, "module", None)
        uses = set(item.fixturenames)
        if (
            uses & (PROCESS_FIXTURES | BROWSER_FIXTURES)
            or item.get_closest_marker("e2e")
            or item.get_closest_marker("browser")
            or (module is not None and _starts_processes(module))
        ):
            item.add_marker(pytest.mark.processes)


class ByProcessGroup(LoadScopeScheduling):
    """xdist's scheduling by scope, a scope being a test's process_group(): the largest, "stacks", goes first to a
    worker of its own; every other module to whichever worker is free."""

    def _split_scope(self, nodeid: str) -> str:
        return process_group(nodeid.split("::", 1)[0])


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, as the process phase runs it, is ByProcessGroup. (xdist's own loadgroup reads
    `xdist_group` marks into node ids, which pytest 9 no longer lets a plugin change: its groups came apart.)"""
    return ByProcessGroup(config, log) if config.getvalue("dist") == "loadgroup" else None


ENGINE_WORDS = re.compile(r"\b(LlamaServer|real_engine|vllm_engine)\b")


class ModuleOrder:
    @pytest.hookimpl(trylast=True)  # after pytest-django's own ordering
    def pytest_collection_modifyitems(self, items):
        """One after the other, the tests of the shared stack (`demo_stack`, SharedStack: started once, stopped after
        its last test); those that register nodes of their own on it (marked `adds_nodes`) after the rest, which
        count its nodes. Just before them the modules that drive Chromium (launched once, SharedChromium). After
        them, last, the modules that need a real engine: on a machine's first run its build (harness.prepare,
        started by `./lifeline test` in the background, 10 to 17 minutes of a busy 2-core machine) has the whole
        run to finish before a test waits for it, and the other tests go on meanwhile."""

        ranks = {}
        for item in items:
            module = getattr(item, "module", None)
            if module not in ranks:
                engine = module is not None and ENGINE_WORDS.search(Path(module.__file__).read_text())
                ranks[module] = 5 if engine else 0
            if BROWSER_FIXTURES & set(item.fixturenames) and ranks[module] != 5:
                ranks[module] = 2

        def rank(item) -> float:
            if "demo_stack" in item.fixturenames:  # a real engine on the shared stack: the last of its block
                engine = ranks[getattr(item, "module", None)] == 5
                return (4 if item.get_closest_marker("adds_nodes") else 3) + 0.5 * engine
            return ranks[getattr(item, "module", None)]

        items.sort(key=rank)  # stable: the order within a rank is kept


def pytest_configure(config):
    config.pluginmanager.register(ModuleOrder(), "lifeline-module-order")


@pytest.fixture(autouse=True, scope="session")
def fast_password_hashing():
    """The cast logs in as four users in about 130 tests: MD5 instead of a million rounds of PBKDF2 each (the hasher
    is not what those tests test; production keeps Django's default, tests/test_security.py checks it)."""
    from django.test.utils import override_settings

    fast = override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"])
    fast.enable()
    yield
    fast.disable()


@pytest.fixture
def cast(db):
    """One user per role: operator, oncall, manager, admin (password: correct-horse-<role>)."""
    from console.actions import set_user_role
    from recovery import roles

    return {role: set_user_role(role, role, password=ROLE_PASSWORD.format(role)) for role in roles.ROLES}


@pytest.fixture(autouse=True)
def no_load_figures_carried_over():
    """A test's last heartbeats' figures wait a quarter second to be published (recovery.events.LoadPublisher): drop
    them at its end, so that they never reach the next test's sockets."""
    yield
    events = sys.modules.get("recovery.events")
    if events is not None:
        events.loads.take()


@pytest.fixture
def commit(django_capture_on_commit_callbacks):
    """Run what waits for the commit (publishing, the incident hooks), as a real commit would."""

    def run(fn, *args, **kwargs):
        with django_capture_on_commit_callbacks(execute=True):
            return fn(*args, **kwargs)

    return run


@pytest.fixture
def react(django_capture_on_commit_callbacks):
    """Run the reactions to what has committed (recovery.reactions), as the worker's beat task does every second."""
    from recovery import reactions

    def run() -> int:
        with django_capture_on_commit_callbacks(execute=True):
            return reactions.process()

    return run


@pytest.fixture
def node_factory(tmp_path):
    """Start real node processes; every one is stopped at the end of the test."""
    started = []

    def start(name: str, *extra: str, env: dict | None = None) -> NodeProcess:
        node = NodeProcess(name, *extra, env=env, log_dir=tmp_path).start()
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


def template_database() -> str:
    """This run's migrated template database (made once, by whichever test process asks first)."""
    from harness import databases

    return databases.template(os.environ["LIFELINE_TEST_RUN"], Path(os.environ["LIFELINE_TEST_SHARED_DIR"]))


@contextlib.contextmanager
def stack_database(tmp_path_factory=None):
    """A database of its own for the processes a stack starts, a copy of the run's migrated template."""
    from harness import databases

    with databases.scratch("lifeline_e2e", template_database()) as url:
        yield url


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment, django_db_blocker):
    """The test database: a copy of the run's template, migrated once for the whole run (and for every process of
    a parallel one), instead of a migration from zero per process."""
    from django.conf import settings
    from django.db import connections

    from harness import databases
    from tests.services import worker_id

    name = f"test_lifeline_{os.environ['LIFELINE_TEST_RUN']}_{worker_id() or 'main'}"
    # Plain synchronous code, even when the run's Chromium is up first (a browser test run alone): Playwright's
    # event loop then runs in this thread, which Django would take for an async context.
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        databases.create(databases.server_url(), name, template_database())
        for alias in (settings.DATABASES["default"], connections["default"].settings_dict):
            alias["NAME"] = name
        connections["default"].close()
    yield
    with django_db_blocker.unblock(), pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        connections["default"].close()
        databases.drop(databases.server_url(), name)


def demo_env(var_dir, database_url: str, suffix: str) -> dict:
    """A stack's environment, its Redis keys under the run's namespace and `suffix`. A poison request's incident ends
    5 s after its last failure, not 10 minutes: a stack shared by several modules is put back between them
    (SharedStack), and it waits for every incident to end."""
    namespace = f"{os.environ['LIFELINE_NAMESPACE']}-{suffix}"
    return stack_env(var_dir, database_url, namespace, LIFELINE_POISON_QUIET_S="5")


class SharedStack:
    """The whole system as `manage.py demo` starts it (web, Celery worker and beat, gateway, 3 nodes), shared by every
    test that takes `demo_stack`: started for the first, put back (DemoStack.put_back: faults cleared, drains
    withdrawn, every node serving and healthy, level 0, the settings as they were) before each later module, and
    stopped after the last (pytest_runtest_teardown). ModuleOrder runs those tests one after another, so a run starts
    it once and it never runs beside another stack on this machine's two cores."""

    def __init__(self):
        self.stack = None
        self.baseline: dict = {}
        self._database = contextlib.ExitStack()

    def get(self, tmp_path_factory) -> DemoStack:
        if self.stack is not None:
            self.stack.put_back(self.baseline)
            return self.stack
        var_dir = tmp_path_factory.mktemp("stack")
        url = self._database.enter_context(stack_database())
        options = ["--nodes", "3", "--spares", "0", "--restart-delay", "6", "--worker-concurrency", "1"]
        options += ["--time-scale", "0.1"]  # a restarted node reloads its model cold: 2.6 s instead of 26
        try:
            self.stack = demo(var_dir, demo_env(var_dir, url, "e2e-shared"), *options).start()
        except BaseException:
            self._database.close()
            raise
        # Its users break a node each within minutes of one another: the cluster breaker (its own tests are in
        # tests/recovery) would stop the next one's automatic cordon. Any share of this fleet may be cordoned.
        share = {"auto_cordon_max_share": 1, "reason": "a stack shared by tests that each break a node"}
        status, answer = self.stack.call("PATCH", "/api/settings", share)
        assert status == 200, answer
        self.baseline = self.stack.baseline()
        return self.stack

    def close(self) -> None:
        """SIGTERM, as a service manager sends it: every child stops as on Ctrl-C, and none is left behind."""
        if self.stack is None:
            return
        stack, self.stack = self.stack, None
        try:
            pids = list(stack.refresh()["pids"].values())
            assert stack.stop(signum=signal.SIGTERM) == 0, stack.log()
            assert [pid for pid in pids if pid_alive(pid)] == []
        finally:
            self._database.close()


_shared_stack = SharedStack()


@pytest.fixture(scope="module")
def demo_stack(tmp_path_factory) -> DemoStack:
    """The run's shared stack (SharedStack), put back as it was started before each module that takes it."""
    return _shared_stack.get(tmp_path_factory)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared stack stops after the last test that takes it: nothing runs beside it."""
    if "demo_stack" in item.fixturenames and (nextitem is None or "demo_stack" not in nextitem.fixturenames):
        _shared_stack.close()


@pytest.fixture
def redis_keys():
    """The Redis the gateway reads, under a namespace of this test's own."""
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
    keys = Keys(os.environ["LIFELINE_NAMESPACE"] + "-gw")
    yield client, keys
    for name in client.scan_iter(match=keys.namespace + ":*"):
        client.delete(name)


@pytest.fixture
async def cluster(node_factory, redis_keys):
    """Nodes started on demand, a routing table, gateways; all closed at the end."""
    c = Cluster(node_factory, redis_keys)
    yield c
    await c.close()


class SharedChromium:
    """Headless Chromium (Debian's, never a downloaded one), launched at the first browser test and kept for every
    browser test that follows. Playwright's synchronous API runs an event loop on the main thread while it is up, in
    which no other test could run its own (nor Django its synchronous database calls): a test that drives no browser
    closes it first. The browser modules run last and together, so a run launches it once."""

    def __init__(self):
        self.playwright = None
        self.browser = None

    def get(self):
        if self.browser is None:
            from playwright.sync_api import sync_playwright

            self.playwright = sync_playwright().start()
            try:
                self.browser = self.playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            except BaseException:
                self.playwright.stop()  # its event loop on the main thread would stop every asyncio test after
                self.playwright = None
                raise
        return self.browser

    def close(self) -> None:
        if self.browser is not None:
            self.browser.close()
            self.playwright.stop()
            self.browser = self.playwright = None

    def __getattr__(self, name):  # new_context(), new_page(), contexts: of the browser, launched if need be
        if name.startswith("_"):
            # Not the browser's: pytest's collection looks for `_mock_name`, `__wrapped__` and the like on every
            # object of a conftest, and each such look launched Chromium in every pytest process.
            raise AttributeError(name)
        return getattr(self.get(), name)


_chromium = SharedChromium()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not BROWSER_FIXTURES & set(getattr(item, "fixturenames", ())):
        _chromium.close()


def pytest_sessionfinish(session):
    _chromium.close()
    _shared_stack.close()


@pytest.fixture(scope="session")
def chromium():
    """The run's Chromium (SharedChromium: launched when first used)."""
    return _chromium


@pytest.fixture(scope="module")
def browser(chromium):
    """The run's Chromium, for one module: each `new_page()` or `new_context()` is a fresh context (no cookie or
    storage from another test), and every context the module opened is closed at its end."""
    yield chromium
    for context in list(chromium.browser.contexts if chromium.browser else ()):
        context.close()
