"""The control plane's side of decoupled MoE deployments (document 001, TARRAGON §5): it owns each deployment's
expert routing table, watches its expert workers, and heals the table when one is lost.

An attention worker finds a dead EW on its own data path within milliseconds and replays on a shadow
(workers.refe); the table it holds still names the dead EW. The control plane, polling every EW's /moe/status each
second (`watch`):
- confirms a loss after MISSES_TO_CONFIRM polls in a row go unanswered, and makes the new table: the lost EW's
  experts served by their shadows, promoted (recovery.policy.moe.after_loss). It pushes it to every attention
  worker, opens (or joins) an incident, and starts background provisioning of a replacement: a standby EW is told
  to load the lost one's experts (at disk bandwidth) and joins the table once it has them.
- a table that would leave an expert with no live location is refused (the expert named on the timeline): the
  attention workers keep the table they have and wait on that expert (a bounded stall) until the replacement
  serves it, or the lost EW comes back.
- a lost EW that answers again either takes its experts back (no replacement took them) or, if one did, is told to
  hold nothing and becomes the standby for the next loss.
- a drain (`drain_ew`) moves an EW's experts onto their shadows first, then empties it.

Every step is a line of the incident's timeline. Each pass also records tokens per expert and EPLB's balancedness
(mean over max tokens per EW) over time, for the MoE page.
"""

import datetime as dt
import logging
from concurrent.futures import ThreadPoolExecutor

from django.db import transaction
from django.utils import timezone

from recovery import events, nodeclient
from recovery.actions import audit, capacity, incidents
from recovery.choices import EventKind, ExpertWorkerState, IncidentStatus
from recovery.models import Cluster, ExpertWorkerNode, Incident, MoeDeployment, Node
from recovery.policy import moe as moe_policy
from workers import catalog
from workers.moe import ExpertRoutingTable, MoeError, balancedness, expert_bytes

log = logging.getLogger(__name__)

MISSES_TO_CONFIRM = 2  # unanswered status polls in a row (one a second) that confirm an EW lost
POLL_TIMEOUT_S = 0.5
PUSH_TIMEOUT_S = 2.0
RESYNC_S = 5.0  # the table is pushed again this often (an attention worker restarted with its first table)
SERIES_POINTS = 600  # balancedness samples kept: ten minutes at one a second
MOE_KIND = "moe"
CANARY_EVERY_S = 10.0  # each serving EW answers a canary dispatch, alone, this often
CANARY_LAYERS = (0, 1)  # the layers a canary asks each expert it holds for
# A stall (an expert with no live location) longer than this takes the deployment's attention workers out of the
# capacity count, so the model's degradation level rises. Shorter, the requests are delayed, not lost: a standby
# loading the experts, or the lost EW restarted, ends it in seconds, and shedding for it would outlast it (the
# level's hold).
STALL_GRACE_S = 10.0

State = ExpertWorkerState


class MoeRefused(ValueError):
    pass


def deployment_of(node: Node) -> MoeDeployment | None:
    """The MoE deployment `node` is an attention worker of, if any."""
    return next((d for d in MoeDeployment.objects.all() if node.name in d.attention_workers), None)


def table(deployment: MoeDeployment) -> ExpertRoutingTable:
    return ExpertRoutingTable.parse(deployment.ert, catalog.MODELS[deployment.model])


@transaction.atomic
def register(
    name: str,
    model: str,
    ews: dict[str, str],
    attention_workers: list[str],
    ert: ExpertRoutingTable,
    standby: dict[str, str] | None = None,
) -> MoeDeployment:
    """Take charge of a deployment: its EWs (name → address) that the table names, standby EWs that hold nothing
    yet, and its attention workers (node names). Registering it again replaces it."""
    if model not in catalog.MODELS or not catalog.MODELS[model].experts:
        raise MoeRefused(f"{model!r} is not an MoE model of the catalog")
    if ert.model != model:
        raise MoeRefused(f"the table is for {ert.model}, the deployment serves {model}")
    unknown = sorted(ert.ews() - set(ews))
    if unknown:
        raise MoeRefused(f"the table names EWs with no address: {', '.join(unknown)}")
    standby = standby or {}
    # Registering again replaces the deployment (a restart of its stack): an incident still open for one of its EWs
    # would be left with nothing to close it. Its EWs are new processes serving the new table: capacity is back.
    now = timezone.now()
    for incident in Incident.objects.filter(details__moe=name, status=IncidentStatus.ACTIVE):
        _capacity_restored(incident, f"{name} registered again, every expert worker of its table a new process", now)
    MoeDeployment.objects.filter(name=name).delete()
    deployment = MoeDeployment.objects.create(
        cluster=Cluster.default(), name=name, model=model, ert=ert.to_json(), attention_workers=list(attention_workers)
    )
    for ew, address in {**ews, **standby}.items():
        ExpertWorkerNode.objects.create(
            deployment=deployment,
            name=ew,
            address=address.rstrip("/"),
            state=State.STANDBY if ew in standby else State.SERVING,
            primaries=ert.primaries_of(ew),
            shadows=ert.shadows_of(ew),
        )
    transaction.on_commit(lambda: events.moe_changed(name))
    return deployment


# --- watching ------------------------------------------------------------------------------------------------------
def _poll(address: str) -> dict | None:
    try:
        status, body = nodeclient.call(address, "GET", "/moe/status", timeout=POLL_TIMEOUT_S)
    except nodeclient.NodeUnreachable:
        return None
    return body if status == 200 else None


def watch(now: dt.datetime | None = None) -> dict[str, list[str]]:
    """One pass over every deployment: poll its EWs, heal its table, record its figures, and every CANARY_EVERY_S
    run its canaries. Returns, per deployment, what it did (for the task's log and the tests)."""
    now = now or timezone.now()
    done = {}
    for deployment in MoeDeployment.objects.all():
        rows = list(deployment.ews.all())
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(rows)))) as pool:
            answers = dict(zip([r.name for r in rows], pool.map(_poll, [r.address for r in rows]), strict=True))
        done[deployment.name] = _watch_one(deployment.pk, answers, now)
        done[deployment.name] += push(deployment.pk, now, force=bool(done[deployment.name]))
        if now.timestamp() - deployment.details.get("canary_at", 0.0) >= CANARY_EVERY_S:
            done[deployment.name] += canary(deployment.pk, now)
    return done


# --- canaries, one EW at a time ------------------------------------------------------------------------------------
def _canary_tokens(experts) -> list[dict]:
    return [
        {"id": f"canary-{layer}-{e}", "expert": e, "activation": f"lifeline canary {layer} {e}".encode().hex()}
        for e in experts
        for layer in CANARY_LAYERS
    ]


def _ask(address: str, experts: list[int]) -> dict[str, str] | None:
    """One EW's answers to the canary dispatch for `experts` ((layer, expert) key → output), or None."""
    answers = {}
    for layer in CANARY_LAYERS:
        tokens = [t for t in _canary_tokens(experts) if t["id"].startswith(f"canary-{layer}-")]
        try:
            status, body = nodeclient.call(
                address, "POST", "/moe/layer", {"layer": layer, "tokens": tokens}, timeout=PUSH_TIMEOUT_S
            )
        except nodeclient.NodeUnreachable:
            return None
        if status != 200:
            return None
        for out in body.get("outputs", []):
            answers[f"{layer}:{out.get('expert')}"] = out.get("output", "")
    return answers


def canary(deployment_id: int, now: dt.datetime | None = None) -> list[str]:
    """Every serving EW answers a canary dispatch for each expert it holds (primaries and shadows), sent to it alone,
    so a wrong answer names the EW. An expert's golden output is recorded once two EWs holding it agree; an EW whose
    answer differs from a golden is silently corrupt: it is drained onto its experts' other locations at once (out
    of the table, told to hold nothing), and the incident says which experts it got wrong."""
    now = now or timezone.now()
    deployment = MoeDeployment.objects.get(pk=deployment_id)
    rows = [r for r in deployment.ews.all() if r.state == State.SERVING and (r.primaries or r.shadows)]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(rows)))) as pool:
        answers = dict(
            zip(
                [r.name for r in rows],
                pool.map(lambda r: _ask(r.address, sorted({*r.primaries, *r.shadows})), rows),
                strict=True,
            )
        )
    return _canary_verdict(deployment_id, answers, now)


@transaction.atomic
def _canary_verdict(deployment_id: int, answers: dict[str, dict | None], now: dt.datetime) -> list[str]:
    deployment = MoeDeployment.objects.select_for_update().get(pk=deployment_id)
    golden = dict(deployment.details.get("canary_golden", {}))
    seen: dict[str, dict[str, str]] = {}  # key -> {EW: output}
    for ew, outputs in answers.items():
        for key, output in (outputs or {}).items():
            seen.setdefault(key, {})[ew] = output
    for key, by_ew in seen.items():
        if key not in golden and len(by_ew) >= 2 and len(set(by_ew.values())) == 1:
            golden[key] = next(iter(by_ew.values()))  # two holders agree
    wrong: dict[str, list[int]] = {}
    for key, by_ew in seen.items():
        for ew, output in by_ew.items():
            if key in golden and output != golden[key]:
                wrong.setdefault(ew, []).append(int(key.split(":")[1]))
    deployment.details = {
        **deployment.details,
        "canary_golden": golden,
        "canary_at": now.timestamp(),
        "canary_failed": sorted(wrong),
    }
    deployment.save()
    actions = [f"canary: {len(answers)} EWs, {len(golden)} goldens"]
    for ew, experts in sorted(wrong.items()):
        actions.append(f"canary mismatch on {ew}")
        _corrupt(deployment, deployment.ews.select_for_update().get(name=ew), sorted(set(experts)), now, actions)
    transaction.on_commit(lambda: events.moe_changed(deployment.name))
    return actions


def _corrupt(deployment, row: ExpertWorkerNode, experts: list[int], now: dt.datetime, actions: list[str]) -> None:
    incident = _incident(deployment, row, now, now, what="silently corrupt")
    incidents.add_event(
        incident,
        EventKind.DETECTED,
        f"canary mismatch on {row.name}: sent to it alone, it answered experts {_list(experts)} differently from "
        "their golden outputs (silent corruption); the attention workers routing to it merged such answers",
        at=now,
        details={"ew": row.name, "experts": experts},
    )
    try:
        drained = _take_out(deployment, row, now, actions)
    except moe_policy.ErtRefused as exc:
        incidents.add_event(
            incident, EventKind.ERT, f"{row.name} stays in the table: {exc}", at=now, details={"refused": str(exc)}
        )
        return
    row.incident = incident
    row.save()
    incidents.add_event(
        incident,
        EventKind.ERT,
        f"table v{drained.version}: {row.name} drained onto its experts' other locations and pushed to the attention "
        "workers; it stays out of service until an operator looks at it",
        at=now,
        details={"version": drained.version},
    )
    audit.record("control-plane", "moe_drain", f"{deployment.name}/{row.name}", "canary mismatch: silent corruption")


@transaction.atomic
def _watch_one(deployment_id: int, answers: dict[str, dict | None], now: dt.datetime) -> list[str]:
    deployment = MoeDeployment.objects.select_for_update().get(pk=deployment_id)
    rows = {r.name: r for r in deployment.ews.select_for_update()}
    actions: list[str] = []
    for name, row in rows.items():  # first every miss counted, so EWs lost together are healed together
        row.misses = 0 if answers.get(name) is not None else row.misses + 1
    for name, row in sorted(rows.items()):
        status = answers.get(name)
        if status is None:
            _missed(deployment, rows, row, now, actions)
        else:
            _answered(deployment, rows, row, status, now, actions)
    _record_figures(deployment, rows, answers, now)
    _stall(deployment, rows, now, actions)
    deployment.updated_at = now
    deployment.save()
    transaction.on_commit(lambda: events.moe_changed(deployment.name))
    return actions


def unlocated(ert: ExpertRoutingTable, rows) -> list[int]:
    """The experts every EW the table names for them is out of service for (lost, drained, or loading its place
    again): a step that selects one cannot finish, so the attention workers wait on it."""
    out = {r.name for r in rows if r.state in (State.DOWN, State.LOADING, State.DRAINED)}
    return [e for e, where in enumerate(ert.experts) if not set(where.ews()) - out]


def _stall(deployment: MoeDeployment, rows: dict[str, ExpertWorkerNode], now: dt.datetime, actions: list[str]):
    """While an expert has no live location the deployment is *stalled*: its attention workers count as out of
    service in the capacity evaluation (recovery.actions.capacity), which raises the model's degradation level and
    sheds its low-priority traffic, and lowers it again (after its hold) once an EW serves the expert. Both moves
    are lines of the incident's timeline, the stall's length on the second."""
    experts = unlocated(table(deployment), rows.values())
    before = deployment.details.get("stalled")
    if bool(experts) == bool(before):
        if experts and experts != before["experts"]:
            deployment.details = {**deployment.details, "stalled": {**before, "experts": experts}}
        return
    details = {k: v for k, v in deployment.details.items() if k != "stalled"}
    workers = ", ".join(deployment.attention_workers)
    if experts:
        since = now.timestamp()
        details["stalled"] = {"experts": experts, "since": since, "degrade_at": since + STALL_GRACE_S}
        text = (
            f"experts {_list(experts)} have no live location: steps that select them wait. Past {STALL_GRACE_S:g} s "
            f"the attention workers ({workers}) count as out of service and {deployment.model}'s degradation level "
            "rises if its capacity falls short"
        )
        actions.append(f"stalled on experts {_list(experts)}")
    else:
        seconds = now.timestamp() - before["since"]
        text = (
            f"every expert has a live location again after a {seconds:.1f} s stall: the attention workers count again"
        )
        actions.append("stall over")
    deployment.details = details
    incident = Incident.objects.filter(details__moe=deployment.name, status=IncidentStatus.ACTIVE).first()
    if incident is not None:
        incidents.add_event(incident, EventKind.DEGRADATION, text, at=now, details={"stalled": experts})
    transaction.on_commit(capacity.evaluate)


def _set_state(row: ExpertWorkerNode, state: str, now: dt.datetime) -> None:
    if row.state != state:
        row.state, row.state_changed_at = state, now


def _missed(
    deployment: MoeDeployment, rows: dict[str, ExpertWorkerNode], row: ExpertWorkerNode, now, actions: list[str]
) -> None:
    if row.state in (State.DOWN, State.DRAINED):
        row.save()
        return
    if row.misses < MISSES_TO_CONFIRM:
        _set_state(row, State.SUSPECT, now)
        row.save()
        return
    if _awaited(row):
        # Not heard since the control plane (re)started: still starting (the stack's restart brings every EW back,
        # and registers the deployment again with their addresses), not lost; the grace's end says if it is.
        _set_state(row, State.SUSPECT, now)
        row.save()
        actions.append(f"{row.name} not heard since the control plane started: awaited until the start-up grace ends")
        return
    symptom_at = row.state_changed_at if row.state == State.SUSPECT else now  # its first unanswered poll
    _set_state(row, State.DOWN, now)
    if row.name not in table(deployment).ews():  # a standby, or a replacement still loading: the table never named it
        if row.replacing:
            actions.append(f"{row.name} lost while loading in place of {row.replacing}")
            if row.incident is not None:
                incidents.add_event(
                    row.incident,
                    EventKind.PROVISIONING,
                    f"{row.name}, loading in place of {row.replacing}, lost too: {row.replacing}'s experts come back "
                    "when it does, or with the next standby",
                    at=now,
                )
        else:
            actions.append(f"standby {row.name} lost")
        row.replacing = ""
        row.save()
        return
    row.save()
    _lose(deployment, rows, row, now, actions, symptom_at)


def _awaited(row: ExpertWorkerNode) -> bool:
    """Whether an EW that misses its polls is awaited rather than lost: within the control plane's start-up grace,
    not heard since the start (as a node that has not served since then is joining, recovery.actions.capacity)."""
    cluster = Cluster.default()
    if cluster.starting_until() is None:
        return False
    return row.last_seen is None or row.last_seen < cluster.state.control_plane_started_at


def _lose(
    deployment: MoeDeployment,
    rows: dict[str, ExpertWorkerNode],
    row: ExpertWorkerNode,
    now: dt.datetime,
    actions: list[str],
    symptom_at: dt.datetime,
) -> None:
    ert = table(deployment)
    experts, shadows = ert.primaries_of(row.name), ert.shadows_of(row.name)
    # Lost while the table named it: if it comes back with its experts and nobody took them, it serves them again.
    lost_from_table = sorted({*deployment.details.get("lost_from_table", []), row.name})
    deployment.details = {**deployment.details, "lost_from_table": lost_from_table}
    incident = _incident(deployment, row, symptom_at, now)
    incidents.add_event(
        incident,
        EventKind.SYMPTOM,
        f"{row.name} did not answer its status poll ({POLL_TIMEOUT_S:g} s)",
        at=symptom_at,
        details={"ew": row.name},
    )
    row.incident = incident
    row.save()
    # Any replacement it was loading for is abandoned: the table never named it.
    incidents.add_event(
        incident,
        EventKind.DETECTED,
        f"{row.name} ({row.address}) of {deployment.name} did not answer {row.misses} status polls in a row: lost. "
        f"It served experts {_list(experts)} and kept shadows of {_list(shadows)}",
        at=now,
        details={"ew": row.name, "experts": experts, "shadows": shadows},
    )
    lost = {r.name for r in rows.values() if r.state == State.DOWN or r.misses >= MISSES_TO_CONFIRM} & ert.ews()
    try:
        healed = moe_policy.after_loss(ert, lost)
    except moe_policy.ErtRefused as exc:
        incidents.add_event(
            incident,
            EventKind.ERT,
            f"table not changed: {exc}. Attention workers wait on expert {exc.expert} (a bounded stall) until a "
            "replacement serves it",
            at=now,
            details={"refused": str(exc), "expert": exc.expert},
        )
        actions.append(f"{row.name} lost; table refused: expert {exc.expert} has no live location")
    else:
        promoted = [e for e in experts if healed.experts[e].primaries != ert.experts[e].primaries]
        _set_table(deployment, healed)
        incidents.add_event(
            incident,
            EventKind.ERT,
            f"table v{healed.version}: experts {_list(promoted)} served by their shadows, promoted "
            f"({_where(healed, promoted)}); pushed to the attention workers",
            at=now,
            details={"version": healed.version, "promoted": promoted},
        )
        actions.append(f"{row.name} lost; table v{healed.version}")
    _provision(deployment, rows, row, experts, shadows, incident, now, actions)


def _incident(
    deployment: MoeDeployment, row: ExpertWorkerNode, symptom_at: dt.datetime, now: dt.datetime, what: str = "lost"
) -> Incident:
    """The deployment's incident still recovering its capacity, joined; or a new one."""
    active = Incident.objects.filter(
        details__moe=deployment.name, status=IncidentStatus.ACTIVE, capacity_restored_at__isnull=True
    ).first()
    if active is not None:
        return active
    title = f"Expert worker {row.name} of {deployment.name} {what}"
    incident = incidents._open(deployment.cluster, title, symptom_at, detected_at=now, kind=MOE_KIND)
    incidents.merge_details(incident, moe=deployment.name, ew=row.name)
    return incident


def _provision(
    deployment: MoeDeployment,
    rows: dict[str, ExpertWorkerNode],
    lost: ExpertWorkerNode,
    experts: list[int],
    shadows: list[int],
    incident: Incident,
    now: dt.datetime,
    actions: list[str],
) -> None:
    """A standby EW loads what `lost` held, in the background; it joins the table once it has it."""
    if not experts and not shadows:
        return
    standby = next((r for _, r in sorted(rows.items()) if r.state == State.STANDBY and not r.misses), None)
    model = catalog.MODELS[deployment.model]
    gigabytes = expert_bytes(model) * len(set(experts) | set(shadows)) / catalog.GB
    if standby is None:
        incidents.add_event(
            incident,
            EventKind.PROVISIONING,
            f"no standby expert worker to provision in place of {lost.name}: its experts come back when it does",
            at=now,
            details={"ew": lost.name},
        )
        actions.append("no standby")
        return
    try:
        status, body = nodeclient.call(
            standby.address, "POST", "/moe/load", {"experts": experts, "shadows": shadows}, timeout=PUSH_TIMEOUT_S
        )
    except nodeclient.NodeUnreachable as exc:
        status, body = 0, {"error": {"message": str(exc)}}
    if status != 202:
        message = (body.get("error") or {}).get("message", f"HTTP {status}")
        incidents.add_event(
            incident,
            EventKind.PROVISIONING,
            f"standby {standby.name} refused to load {lost.name}'s experts: {message}",
            at=now,
            details={"ew": standby.name, "status": status},
        )
        actions.append(f"standby {standby.name} refused")
        return
    standby.replacing, standby.incident = lost.name, incident
    _set_state(standby, State.LOADING, now)
    standby.save()
    incidents.add_event(
        incident,
        EventKind.PROVISIONING,
        f"provisioning {standby.name} in place of {lost.name}: loading experts {_list(experts)} and shadows "
        f"{_list(shadows)} ({gigabytes:.1f} GB at {catalog.DISK_GBPS:g} GB/s, about {body.get('load_s', 0):.1f} s)",
        at=now,
        details={"ew": standby.name, "in_place_of": lost.name, "load_s": body.get("load_s")},
    )
    actions.append(f"provisioning {standby.name}")


def _answered(
    deployment: MoeDeployment,
    rows: dict[str, ExpertWorkerNode],
    row: ExpertWorkerNode,
    status: dict,
    now: dt.datetime,
    actions: list[str],
) -> None:
    was = row.state
    pid, row.pid = row.pid, status.get("pid", row.pid)
    if was not in (State.DOWN, State.DRAINED) and pid is not None and row.pid != pid:
        # Lost and started again between two polls (its supervisor was quicker than MISSES_TO_CONFIRM): a loss all
        # the same. The AWs that found it down wait for a table that gives it anew.
        was = _restarted(deployment, row, pid, now, actions)
    row.misses, row.last_seen = 0, now
    row.primaries, row.shadows = status.get("primaries", []), status.get("shadows", [])
    row.memory, row.tokens = status.get("memory_bytes", {}), status.get("tokens_per_expert", {})
    row.refused, row.gpu = int(status.get("refused", 0)), status.get("gpu", row.gpu)
    reported = status.get("state", State.SERVING)
    if was == State.DRAINED:
        row.save()
        return
    if was == State.DOWN:
        _came_back(deployment, rows, row, now, actions)
        return
    if row.replacing and reported == State.SERVING:
        _replacement_ready(deployment, row, now, actions)
        return
    if row.name in deployment.details.get("reloading", []):
        if reported == State.SERVING:
            _reloaded(deployment, rows, row, now, actions)
        else:
            row.save()
        return
    if reported == State.LOADING:
        _set_state(row, State.LOADING, now)
    elif reported == State.STANDBY and not row.replacing:
        _set_state(row, State.STANDBY, now)
    elif not row.replacing and row.name not in table(deployment).ews():
        # Holding experts the table does not give it (a replacement called off as it finished): it stands by.
        _stand_by(row, now)
    elif not row.replacing:
        _set_state(row, State.SERVING, now)
    row.save()


def _restarted(deployment: MoeDeployment, row: ExpertWorkerNode, pid: int, now: dt.datetime, actions: list[str]):
    """An EW that answers as another process than at the last poll: an incident (opened or joined), and it is
    handled as one lost and back (`_came_back`). Returns the state it is taken to have been in: DOWN."""
    incident = _incident(deployment, row, row.last_seen or now, now, what="restarted")
    incidents.add_event(
        incident,
        EventKind.DETECTED,
        f"{row.name} ({row.address}) of {deployment.name} answers as another process (pid {pid} → {row.pid}): it "
        "was lost and started again between two status polls",
        at=now,
        details={"ew": row.name, "pid": row.pid, "was": pid},
    )
    row.incident = incident
    if row.replacing:  # what it was loading is gone with the process, as when a loading replacement is lost
        incidents.add_event(
            incident,
            EventKind.PROVISIONING,
            f"{row.name} was loading in place of {row.replacing}: {row.replacing}'s experts come back when it does, "
            "or with the next standby",
            at=now,
        )
        row.replacing = ""
    _set_state(row, State.DOWN, now)
    actions.append(f"{row.name} restarted")
    return State.DOWN


def _replacement_ready(deployment: MoeDeployment, row: ExpertWorkerNode, now: dt.datetime, actions: list[str]):
    ert = table(deployment)
    lost = row.replacing
    experts, shadows = list(row.primaries), list(row.shadows)
    # The lost EW may still be in the table (its loss was refused: an expert had no other location); it leaves it
    # now that the replacement serves its experts.
    joined = moe_policy.with_replacement(ert, experts, row.name, shadow_experts=shadows, replacing=lost)
    _set_table(deployment, joined)
    deployment.details = {
        **deployment.details,
        "replaced": {**deployment.details.get("replaced", {}), lost: row.name},
        "lost_from_table": [n for n in deployment.details.get("lost_from_table", []) if n != lost],
    }
    row.replacing = ""
    _set_state(row, State.SERVING, now)
    incident = row.incident
    row.save()
    actions.append(f"{row.name} joined in place of {lost}")
    if incident is None:
        return
    incidents.add_event(
        incident,
        EventKind.ERT,
        f"table v{joined.version}: {row.name} serves experts {_list(experts)} in place of {lost} (their promoted "
        f"shadows are shadows again) and keeps shadows of {_list(shadows)}; pushed to the attention workers",
        at=now,
        details={"version": joined.version, "ew": row.name, "in_place_of": lost},
    )
    _capacity_restored(incident, f"{row.name} serves in place of {lost}", now)


def _came_back(
    deployment: MoeDeployment, rows: dict[str, ExpertWorkerNode], row: ExpertWorkerNode, now, actions: list[str]
) -> None:
    """A lost EW answers again: it takes its experts back if no replacement has them, else it becomes a standby."""
    replaced = row.name in deployment.details.get("replaced", {}) or any(
        r.replacing == row.name for r in rows.values() if r is not row
    )
    ert = table(deployment)
    incident = row.incident
    if row.name in ert.ews():
        # Never taken out of the table (the table without it was refused: an expert had nowhere else to go). If it
        # came back without what the table says it holds, it loads that first.
        want = {"experts": ert.primaries_of(row.name), "shadows": ert.shadows_of(row.name)}
        if set(row.primaries) != set(want["experts"]) or set(row.shadows) != set(want["shadows"]):
            if _reload(deployment, row, want, now, actions):
                return
        for other in rows.values():
            if other.replacing == row.name:  # still loading in its place: called off, it stands by again
                other.replacing = ""
                _stand_by(other, now)
                actions.append(f"{other.name} called off")
                if incident is not None:
                    incidents.add_event(
                        incident,
                        EventKind.PROVISIONING,
                        f"{row.name} is back before {other.name} finished loading in its place: {other.name} is "
                        "called off and stands by",
                        at=now,
                    )
        _back_in_table(deployment, rows, row, now, actions, "answers again and still has its place in the table")
        return
    if not replaced and row.primaries and row.name in deployment.details.get("lost_from_table", []):
        joined = moe_policy.with_replacement(ert, row.primaries, row.name, shadow_experts=row.shadows)
        _set_table(deployment, joined)
        _set_state(row, State.SERVING, now)
        text = f"{row.name} answers again and serves its experts {_list(row.primaries)}: table v{joined.version}"
        actions.append(f"{row.name} back")
        if incident is not None:
            incidents.add_event(incident, EventKind.ERT, text, at=now, details={"version": joined.version})
            _capacity_restored(incident, f"{row.name} back", now)
    else:
        try:
            nodeclient.call(row.address, "POST", "/moe/load", {"experts": [], "shadows": []}, timeout=PUSH_TIMEOUT_S)
        except nodeclient.NodeUnreachable:
            row.save()
            return
        row.primaries, row.shadows = [], []
        _set_state(row, State.STANDBY, now)
        replaced_by = {k: v for k, v in deployment.details.get("replaced", {}).items() if k != row.name}
        deployment.details = {**deployment.details, "replaced": replaced_by}
        actions.append(f"{row.name} back as standby")
        if incident is not None:
            incidents.add_event(
                incident,
                EventKind.PROVISIONING,
                f"{row.name} answers again; its experts are served elsewhere, so it holds nothing and is the "
                "standby for the next loss",
                at=now,
            )
    deployment.details = {
        **deployment.details,
        "lost_from_table": [n for n in deployment.details.get("lost_from_table", []) if n != row.name],
    }
    row.incident = None
    row.save()


def _stand_by(row: ExpertWorkerNode, now: dt.datetime) -> None:
    """Tell an EW outside the table to hold nothing; it is the standby once it has said yes."""
    try:
        status, _ = nodeclient.call(
            row.address, "POST", "/moe/load", {"experts": [], "shadows": []}, timeout=PUSH_TIMEOUT_S
        )
    except nodeclient.NodeUnreachable:
        status = 0
    if status == 202:
        row.primaries, row.shadows = [], []
        _set_state(row, State.STANDBY, now)
    row.save()


def _reload(deployment: MoeDeployment, row: ExpertWorkerNode, want: dict, now: dt.datetime, actions: list[str]) -> bool:
    """Tell an EW that is back, still in the table, to load what the table says it holds; True once asked."""
    try:
        status, body = nodeclient.call(row.address, "POST", "/moe/load", want, timeout=PUSH_TIMEOUT_S)
    except nodeclient.NodeUnreachable:
        status, body = 0, {}
    if status != 202:
        return False
    reloading = sorted({*deployment.details.get("reloading", []), row.name})
    deployment.details = {**deployment.details, "reloading": reloading}
    _set_state(row, State.LOADING, now)
    row.save()
    actions.append(f"{row.name} reloading")
    if row.incident is not None:
        incidents.add_event(
            row.incident,
            EventKind.PROVISIONING,
            f"{row.name} answers again without the experts the table gives it: loading experts "
            f"{_list(want['experts'])} and shadows {_list(want['shadows'])} (about {body.get('load_s', 0):.1f} s)",
            at=now,
            details={"ew": row.name, "load_s": body.get("load_s")},
        )
    return True


def _reloaded(deployment: MoeDeployment, rows, row: ExpertWorkerNode, now: dt.datetime, actions: list[str]) -> None:
    """An EW that reloaded its place in the table serves it."""
    deployment.details = {
        **deployment.details,
        "reloading": [n for n in deployment.details["reloading"] if n != row.name],
    }
    _back_in_table(deployment, rows, row, now, actions, "holds its experts again")


def _back_in_table(deployment: MoeDeployment, rows, row: ExpertWorkerNode, now, actions: list[str], how: str) -> None:
    """An EW the table still names serves what it gives it again (it was never taken out: the table without it was
    refused): the table, a version on, tells the attention workers to use it again."""
    ert = table(deployment)
    again = ExpertRoutingTable(ert.model, ert.version + 1, ert.experts)
    _set_table(deployment, again)
    deployment.details = {
        **deployment.details,
        "lost_from_table": [n for n in deployment.details.get("lost_from_table", []) if n != row.name],
    }
    _set_state(row, State.SERVING, now)
    incident, row.incident = row.incident, None
    row.save()
    actions.append(f"{row.name} back in the table")
    if incident is None:
        return
    incidents.add_event(
        incident,
        EventKind.ERT,
        f"{row.name} {how}: table v{again.version} tells the attention workers to use it again",
        at=now,
        details={"version": again.version},
    )
    out = (State.DOWN, State.LOADING)
    if not any(r.state in out and r.name in ert.ews() for r in rows.values() if r is not row):
        _capacity_restored(incident, f"{row.name} back", now)


def _capacity_restored(incident: Incident, how: str, now: dt.datetime) -> None:
    if incident.status != IncidentStatus.ACTIVE or incident.capacity_restored_at is not None:
        return
    Incident.objects.filter(pk=incident.pk).update(capacity_restored_at=now)
    incident.capacity_restored_at = now
    seconds = (now - incident.opened_at).total_seconds()
    incidents.add_event(
        incident,
        EventKind.CAPACITY_RESTORED,
        f"Capacity restored {seconds:.1f} s after the first symptom: {how}",
        at=now,
        details={"seconds": round(seconds, 3)},
    )
    transaction.on_commit(lambda pk=incident.pk: events.incident_changed(pk))
    incidents._stabilize(incident, now)


def _set_table(deployment: MoeDeployment, ert: ExpertRoutingTable) -> None:
    deployment.ert = ert.to_json()
    deployment.details = {**deployment.details, "pushed": {}}  # every attention worker is due the new version


# --- pushing the table ---------------------------------------------------------------------------------------------
def push(deployment_id: int, now: dt.datetime, force: bool) -> list[str]:
    """The watch's push, outside its transaction (an attention worker slow to answer holds no lock): the table in
    force sent, and which AWs took it recorded, unless the table changed meanwhile (the next pass sends that one)."""
    deployment = MoeDeployment.objects.get(pk=deployment_id)
    actions: list[str] = []
    _push(deployment, now, force, actions)
    with transaction.atomic():
        current = MoeDeployment.objects.select_for_update().get(pk=deployment_id)
        if current.ert["version"] != deployment.ert["version"]:
            return actions
        taken = {key: deployment.details[key] for key in ("pushed", "pushed_at")}
        current.details = {**current.details, **taken}
        current.save(update_fields=["details"])
        if actions:
            transaction.on_commit(lambda: events.moe_changed(current.name))
    return actions


def _push(deployment: MoeDeployment, now: dt.datetime, force: bool, actions: list[str]) -> None:
    """The table in force to every attention worker that has not taken this version (or each RESYNC_S), all at once."""
    version = deployment.ert["version"]
    pushed = dict(deployment.details.get("pushed", {}))
    last = deployment.details.get("pushed_at", 0.0)
    due = force or now.timestamp() - last >= RESYNC_S
    addresses = dict(deployment.ews.values_list("name", "address"))
    body = {"ert": deployment.ert, "addresses": {ew: addresses[ew] for ew in table(deployment).ews()}}
    nodes = [
        node
        for node in Node.objects.filter(name__in=deployment.attention_workers).exclude(address="")
        if pushed.get(node.name) != version or due
    ]

    def send(node: Node) -> tuple[int, dict]:
        try:
            return nodeclient.call(node.address, "POST", "/agent/ert", body, timeout=PUSH_TIMEOUT_S)
        except nodeclient.NodeUnreachable:
            return 0, {}

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        answers = list(pool.map(send, nodes))
    for node, (status, answer) in zip(nodes, answers, strict=True):
        if status in (200, 409):  # 409: it has this version (or newer) already
            if pushed.get(node.name) != version and status == 200:
                actions.append(f"v{version} to {node.name}")
            pushed[node.name] = version
        elif status:
            log.warning("%s refused table v%s: %s", node.name, version, answer)
    deployment.details = {**deployment.details, "pushed": pushed, "pushed_at": now.timestamp() if due else last}


# --- figures -------------------------------------------------------------------------------------------------------
def _record_figures(
    deployment: MoeDeployment, rows: dict[str, ExpertWorkerNode], answers: dict[str, dict | None], now: dt.datetime
) -> None:
    """Tokens per expert since registration and per EW since the last pass (an EW's counters restart with it), and
    balancedness over the EWs that served."""
    details = dict(deployment.details)
    last = details.get("last_counts", {})
    per_expert = {int(k): v for k, v in details.get("tokens_per_expert", {}).items()}
    per_ew: dict[str, int] = {}
    counts = {}
    for name, status in answers.items():
        if status is None:
            continue
        now_counts = {int(k): int(v) for k, v in status.get("tokens_per_expert", {}).items()}
        before = {int(k): v for k, v in last.get(name, {}).items()}
        if any(now_counts.get(e, 0) < n for e, n in before.items()):
            before = {}  # the EW restarted: its counters began again
        served = 0
        for expert, n in now_counts.items():
            delta = n - before.get(expert, 0)
            per_expert[expert] = per_expert.get(expert, 0) + delta
            served += delta
        per_ew[name] = served
        counts[name] = now_counts
    serving = {name: n for name, n in per_ew.items() if rows[name].state == State.SERVING}
    series = list(details.get("series", []))
    even = balancedness(serving)
    if even is not None:
        series.append({"at": now.timestamp(), "balancedness": round(even, 4), "per_ew": per_ew})
    details.update(
        last_counts={k: {str(e): n for e, n in v.items()} for k, v in counts.items()},
        tokens_per_expert={str(e): n for e, n in sorted(per_expert.items())},
        series=series[-SERIES_POINTS:],
    )
    deployment.details = details


# --- drains --------------------------------------------------------------------------------------------------------
@transaction.atomic
def drain_ew(deployment: MoeDeployment, ew: str, actor: str, reason: str) -> ExpertRoutingTable:
    """Take `ew` out of service on purpose: its experts move to their shadows first (the table without it is pushed
    to every attention worker), then it is told to hold nothing. Refused, naming the expert, when one would have
    no other location."""
    deployment = MoeDeployment.objects.select_for_update().get(pk=deployment.pk)
    row = deployment.ews.select_for_update().get(name=ew)
    if ew not in table(deployment).ews():
        raise MoeRefused(f"{ew} serves nothing in {deployment.name}'s table: there is nothing to drain")
    try:
        drained = _take_out(deployment, row, timezone.now(), [])
    except moe_policy.ErtRefused as exc:
        raise MoeRefused(f"cannot drain {ew}: {exc}") from None
    audit.record(actor, "moe_drain", f"{deployment.name}/{ew}", reason, version=drained.version)
    transaction.on_commit(lambda: events.moe_changed(deployment.name))
    return drained


def _take_out(deployment: MoeDeployment, row: ExpertWorkerNode, now, actions: list[str]) -> ExpertRoutingTable:
    """`row` out of the table (its experts on their other locations, pushed to every AW), told to hold nothing, and
    DRAINED: out of service until a person looks at it. ErtRefused, naming the expert, when one would have no
    other location."""
    drained = moe_policy.after_loss(table(deployment), {row.name})
    _set_table(deployment, drained)
    _push(deployment, now, force=True, actions=actions)
    deployment.save()
    try:
        status, answer = nodeclient.call(
            row.address, "POST", "/moe/load", {"experts": [], "shadows": []}, timeout=PUSH_TIMEOUT_S
        )
    except nodeclient.NodeUnreachable as exc:
        status, answer = 0, {"error": {"message": str(exc)}}
    if status != 202:  # it is out of the table already: no attention worker sends it tokens
        log.warning("%s drained but still holds its experts: %s", row.name, (answer.get("error") or {}).get("message"))
    _set_state(row, State.DRAINED, now)
    row.save()
    return drained


def _list(experts) -> str:
    return ", ".join(map(str, experts)) or "none"


def _where(ert: ExpertRoutingTable, experts: list[int]) -> str:
    return ", ".join(f"{e} on {ert.experts[e].primaries[0]}" for e in experts) or "none moved"


def shadow_memory(deployment: MoeDeployment) -> dict:
    """Memory the table's shadows take, and the share of experts with one (the MoE page's figures)."""
    ert = table(deployment)
    model = catalog.MODELS[deployment.model]
    memory = moe_policy.memory(ert, model)
    return {
        "shadow_bytes": sum(m["shadows"] for m in memory.values()),
        "primary_bytes": sum(m["primaries"] for m in memory.values()),
        "coverage": moe_policy.shadow_coverage(ert),
    }


__all__ = ["MoeError", "MoeRefused", "drain_ew", "register", "table", "watch"]
