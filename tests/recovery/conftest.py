import pytest

AGENT = "agent-token-for-tests"
FAULT = "fault-token-for-tests"


@pytest.fixture
def tokens(settings):
    """The node tokens the control plane presents, and e-mail kept in memory."""
    settings.LIFELINE_AGENT_TOKEN = AGENT
    settings.LIFELINE_FAULT_TOKEN = FAULT
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
