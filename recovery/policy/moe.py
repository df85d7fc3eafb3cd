"""The expert routing table's plan and its changes (document 001, TARRAGON §4.2, §5.3, §5.4), as pure functions.

- `plan`: each expert's primary on one EW, spread so the EWs carry even expected load (hot experts first, each to
  the least-loaded EW with room), then shadows, inactive copies in the EWs' residual memory, hot experts first,
  never on the expert's own primary, until no EW has room for another: the memory each EW spends is accounted.
- `after_loss`: the table once EWs are lost: an expert whose primaries are all gone is served by its first live
  shadow, promoted; one with no live location at all is refused, naming it (the control plane then raises the
  degradation level and provisions; the table never drops an expert).
- `with_replacement`: a provisioned EW takes back the experts a lost one served; the shadows promoted for them go
  back to being shadows.

The table itself, and what an AW does with it, is `workers.moe`.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from workers.catalog import Model
from workers.moe import ExpertRoutingTable, Locations, expert_bytes, require_moe


@dataclass(frozen=True)
class ExpertWorker:
    """An EW as the planner sees it: its name and the GPU memory it has for expert weights."""

    name: str
    memory_bytes: int


class ErtRefused(ValueError):
    """A table that cannot be made as asked; `expert` names the expert left without a location, when one is."""

    def __init__(self, message: str, expert: int | None = None):
        super().__init__(message)
        self.expert = expert


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def plan(
    model: Model,
    ews: Sequence[ExpertWorker],
    loads: Mapping[int, float] | None = None,
    *,
    shadows: bool = True,
    version: int = 1,
) -> ExpertRoutingTable:
    """Primaries spread by load, then one shadow per expert, hottest first, where memory allows."""
    require_moe(model)
    if not ews:
        raise ErtRefused(f"{model.key} needs at least one expert worker")
    if len({ew.name for ew in ews}) != len(ews):
        raise ErtRefused("two expert workers share a name")
    size = expert_bytes(model)
    loads = loads or {}
    order = sorted(range(model.experts), key=lambda e: (-loads.get(e, 0.0), e))  # hottest first
    free = {ew.name: ew.memory_bytes for ew in ews}
    need, have = size * model.experts, sum(free.values())
    if need > have:
        raise ErtRefused(
            f"the {model.experts} experts of {model.key} need {_gb(need)} ({_gb(size)} each); "
            f"the {len(ews)} expert workers hold {_gb(have)}: add expert workers"
        )
    carried = {ew.name: 0.0 for ew in ews}
    served = {ew.name: 0 for ew in ews}
    share = -(-model.experts // len(ews))  # an even count of primaries each, so every EW keeps room for shadows
    primary: dict[int, str] = {}
    for expert in order:
        room = [name for name in free if free[name] >= size]
        if not room:  # enough memory in total, but split so that no EW has room for a whole expert
            raise ErtRefused(
                f"no expert worker has {_gb(size)} left for expert {expert} of {model.key}: "
                "the workers' memory is too fragmented for its experts",
                expert,
            )
        # Even counts first, then even expected load (hot experts first, each to the least-loaded EW: a hot one is
        # paired with cold ones); equal load (no measurements yet) fills the EWs in turn.
        room = [name for name in room if served[name] < share] or room
        target = min(room, key=lambda name: (carried[name], -free[name], name))
        primary[expert] = target
        served[target] += 1
        free[target] -= size
        carried[target] += loads.get(expert, 0.0) or 1e-9
    shadow: dict[int, str] = {}
    if shadows:
        for expert in order:
            room = [name for name in free if free[name] >= size and name != primary[expert]]
            if not room:
                continue  # no EW but its own has room: it goes without, a colder one may still get one
            target = max(room, key=lambda name: (free[name], name))
            shadow[expert] = target
            free[target] -= size
    experts = tuple(Locations((primary[e],), (shadow[e],) if e in shadow else ()) for e in range(model.experts))
    return ExpertRoutingTable(model.key, version, experts)


def after_loss(ert: ExpertRoutingTable, lost: Iterable[str]) -> ExpertRoutingTable:
    """The table without the `lost` EWs: each expert keeps its live primaries, or its first live shadow becomes
    its primary. Refused, naming the expert, when one would have no live location."""
    lost = set(lost)
    experts = []
    for i, loc in enumerate(ert.experts):
        primaries = tuple(ew for ew in loc.primaries if ew not in lost)
        shadows = tuple(ew for ew in loc.shadows if ew not in lost)
        if not primaries and shadows:
            primaries, shadows = shadows[:1], shadows[1:]
        if not primaries:
            gone = ", ".join(loc.ews()) or "none"
            raise ErtRefused(
                f"expert {i} of {ert.model} would have no live location: every EW holding it ({gone}) is lost; "
                "provision a replacement expert worker",
                i,
            )
        experts.append(Locations(primaries, shadows))
    return ExpertRoutingTable(ert.model, ert.version + 1, tuple(experts))


def with_replacement(
    ert: ExpertRoutingTable,
    experts: Iterable[int],
    ew: str,
    keep_shadows: bool = True,
    shadow_experts: Iterable[int] = (),
    replacing: str | None = None,
) -> ExpertRoutingTable:
    """A provisioned EW `ew` serves `experts` (those a lost EW served) as their primary; a shadow promoted for one
    of them in the meantime goes back to being its shadow (it has stayed loaded). It also keeps `shadow_experts`
    (the lost EW's shadows) as their shadow, after the ones they have. `replacing`: the lost EW, where the table
    still names it (its loss was refused: an expert had no other location); it leaves the table here."""
    if replacing is not None:
        ert = ExpertRoutingTable(
            ert.model,
            ert.version,
            tuple(
                Locations(
                    tuple(p for p in loc.primaries if p != replacing), tuple(s for s in loc.shadows if s != replacing)
                )
                for loc in ert.experts
            ),
        )
    taken, shadowed = set(experts), set(shadow_experts) - set(experts)
    rows = []
    for i, loc in enumerate(ert.experts):
        if i in shadowed and ew not in loc.ews():
            rows.append(Locations(loc.primaries, loc.shadows + (ew,)))
            continue
        if i not in taken:
            rows.append(loc)
            continue
        promoted = tuple(p for p in loc.primaries if p != ew)
        shadows = (promoted + loc.shadows) if keep_shadows else loc.shadows
        rows.append(Locations((ew,), tuple(dict.fromkeys(s for s in shadows if s != ew))))
    joined = ExpertRoutingTable(ert.model, ert.version + 1, tuple(rows))
    for i, loc in enumerate(joined.experts):
        if not loc.primaries:
            raise ErtRefused(f"expert {i} of {ert.model} would have no live location with {ew} in {replacing}'s place")
    return joined


def memory(ert: ExpertRoutingTable, model: Model) -> dict[str, dict[str, int]]:
    """Per EW, the bytes its primaries and its shadows take."""
    size = expert_bytes(model)
    return {
        ew: {"primaries": size * len(ert.primaries_of(ew)), "shadows": size * len(ert.shadows_of(ew))}
        for ew in sorted(ert.ews())
    }


def shadow_coverage(ert: ExpertRoutingTable) -> float:
    """The share of experts with at least one shadow."""
    return sum(1 for loc in ert.experts if loc.shadows) / len(ert.experts) if ert.experts else 0.0
