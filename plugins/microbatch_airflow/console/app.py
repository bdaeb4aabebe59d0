"""The console's FastAPI app: a JSON API over the pipelines' tables, and the page that draws it.

Routes (under the API server's ``/microbatch`` prefix):

* ``GET /api/pipelines``: each pipeline's position, status, state version,
  lag (in the source's unit, with the age of the oldest data waiting) and
  problems, as ``microbatch status`` reports them; probed in the background
  (`console.probes`), so a source that does not answer shows its last known
  value with its age, or "probing", and slows no other.
* ``GET /api/pipelines/{name}/batches?limit=N``: the newest ledger rows,
  with the fields of ``microbatch history --json``, each marked live or
  not; ``&group=batch``: one entry per batch instead (its commit, else its
  plan), with what it read, whether a pending plan's run is still going,
  and the downstream runs its asset event triggered.
* ``GET /api/pipelines/{name}/quarantine?batch_id=K&reason=R&lineage=live|all&limit=N``:
  quarantined records of the live lineage (``all``: rewound batches' too),
  with counts by reason; ``&format=csv`` downloads every matching record.
* ``POST /api/pipelines/{name}/unpause``: unpauses the pipeline's DAG, as
  the caller (a rewind's run waits while its DAG is paused).
* ``POST /api/pipelines/{name}/rewind``: triggers a run of the pipeline's DAG
  with ``rewind_to_batch`` through Airflow's own REST API, as the caller, so
  the rewind is a DAG run like any other: audited, visible in the grid;
  ``GET /api/pipelines/{name}/runs/{run_id}``: that run's state, which the
  page follows until it ends.
* ``GET /``: the page; ``/static/...``: its script and styles (served from
  here: the machines that run Airflow may have no internet).

Airflow does not protect a plugin's app, so every data route resolves the
caller as Airflow's own API does (its JWT, from the ``Authorization`` header
or the UI's session cookie) and asks the auth manager: viewing needs read
access to the pipeline's DAG, rewinding needs the right to trigger it.

The tables are read with delta-rs in worker threads: a read never blocks
the API server's event loop. Reads are by position (`inspect.recent`), so a
page costs what it shows, not what the ledger holds.
"""

from __future__ import annotations

import csv
import html
import io
import threading
from pathlib import Path
from urllib.parse import quote
from typing import Annotated, Any, Literal

import anyio
import httpx
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN
from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import bearer_scheme, get_user
from airflow.configuration import conf

from microbatch_airflow.airflow_spec import airflow_spec
from microbatch_airflow.urls import airflow_root
from microbatch_airflow.console.probes import SUMMARY_FIELDS, Probes, ledger_mark
from microbatch_airflow.dag_factory import SpecScan, pipelines_dir, scan_specs
from microbatch_airflow.hooks import connections
from spark_jobs.core import inspect
from spark_jobs.core.rewind import check_rewind
from spark_jobs.core.spec import PipelineSpec
from spark_jobs.errors import RewindError, first_line

__all__ = ["create_app"]

STATIC = Path(__file__).parent / "static"
User = Annotated[BaseUser, Depends(get_user)]


def _specs_dir() -> Path:
    """The folder the DAG factory reads: ``MICROBATCH_PIPELINES_DIR``, else ``<dags_folder>/pipelines``."""
    return pipelines_dir(Path(conf.get("core", "dags_folder")) / "pipelines")


class _SpecFolder:
    """The pipelines folder's specs, parsed again only when one of its files
    changed: a request costs a listing and a stat per file, not a parse of
    every spec (0.3 s for 30 specs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[Any, ...] | None = None
        self._found = SpecScan({}, {}, {})

    def scan(self) -> SpecScan:
        folder = _specs_dir()
        files = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
        try:
            key = (str(folder), tuple((f.name, st.st_mtime_ns, st.st_size) for f in files for st in [f.stat()]))
        except OSError:  # a file went away while listed: parse what is there, cache nothing
            return scan_specs(folder)
        with self._lock:
            if key != self._key:
                self._found, self._key = scan_specs(folder), key
            return self._found


_SPECS = _SpecFolder()


def _allowed(user: BaseUser, method: str, dag_id: str | None, entity: DagAccessEntity | None = None) -> bool:
    return get_auth_manager().is_authorized_dag(
        method=method,  # type: ignore[arg-type]
        access_entity=entity,
        details=DagDetails(id=dag_id) if dag_id else None,
        user=user,
    )


def _source_text(spec: PipelineSpec) -> str:
    source = spec.source
    where = getattr(source, "topic", None) or spec.source_path
    return f"{source.type}: {where}"


def _summary(spec: PipelineSpec) -> dict[str, Any]:
    """One pipeline's line of ``GET /api/pipelines`` (runs in a worker thread)."""
    base: dict[str, Any] = {
        "name": spec.name, "dag_id": spec.name, "source": _source_text(spec), "spec_path": str(spec.spec_path), "layout": spec.state.layout,
    }
    try:
        with connections(spec):
            st = inspect.status(spec)
    except Exception as exc:  # noqa: BLE001 - one unreadable pipeline must not hide the others
        return {**dict.fromkeys(SUMMARY_FIELDS), **base, "status": "unreadable", "problems": [first_line(exc)]}
    d = st.to_dict()
    problems = st.note.splitlines() if st.note else []
    alert = _lag_alert(spec, d["lag"])
    if st.head is None and st.source_unavailable and problems == [st.source_unavailable]:
        # A pipeline that never ran, whose source is not there yet (a landing
        # folder nothing wrote to, a broker not started): a new user's first
        # look says what it waits for, not a red problem. After a batch, a
        # source gone is a problem.
        state, problems = "waiting", [f"waiting for its source (no batch yet): {st.source_unavailable}"]
    elif problems:
        state = "problem"
    elif alert:
        state, problems = "lagging", [alert]
    elif st.head is None:
        state = "new"
    else:
        state = "behind" if st.lag and st.lag.count else "up to date"
    return {
        **base,
        "epoch": d["epoch"],
        "batch_id": d["last_batch"],
        "status": state,
        "state_version": d["state_version"],
        "lag": d["lag"],
        "last_committed_at": d["committed_at"],
        "problems": problems,
        "oldest_rewindable": d["oldest_rewindable"],
        "end_offsets": d["end_offsets"],
        "quarantined": d["quarantined"],
        # Event time: the watermark the next batch is judged against, and the policy for what is older.
        "watermark": d["watermark"],
        "late_policy": spec.event_time.late if spec.event_time is not None else None,
        # Event-time windows: the table of final rows, its rows and how far it is.
        "final": d["final"],
        # The state's table has deletion vectors: readers older than Delta 2.3 cannot read it.
        "merged_on_read": d["merged_on_read"],
    }


def _lag_alert(spec: PipelineSpec, lag: dict[str, Any] | None) -> str | None:
    """What crosses the spec's `airflow.lag_alert`, if anything (the status turns red)."""
    try:
        alert = airflow_spec(spec).lag_alert
    except Exception:  # noqa: BLE001 - a broken airflow block is the DAG factory's to report
        return None
    if alert is None or not lag:
        return None
    if alert.count is not None and lag["count"] >= alert.count:
        unit = lag["unit"].removesuffix("s") if lag["count"] == 1 else lag["unit"]
        return f"{lag['count']:,} {unit} waiting, at or over the alert threshold of {alert.count:,} (airflow.lag_alert.count)"
    age = lag.get("oldest_age_s")
    if alert.age_seconds is not None and age is not None and age >= alert.age_seconds:
        return f"the oldest data has waited {age:,.0f} s, at or over the alert threshold of {alert.age_seconds:,.0f} s (airflow.lag_alert.age_seconds)"
    return None


async def _spec(name: str, user: BaseUser, method: str = "GET", entity: DagAccessEntity | None = None) -> PipelineSpec:
    """The spec of pipeline `name`, if the caller may `method` its DAG (404 for no such pipeline, 403 if not allowed)."""
    if not _allowed(user, "GET", name):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"you may not read DAG {name!r}")
    if (method, entity) != ("GET", None) and not _allowed(user, method, name, entity):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"you may view pipeline {name!r} but not trigger its DAG")
    spec = (await anyio.to_thread.run_sync(_SPECS.scan)).specs.get(name)
    if spec is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no pipeline named {name!r} in {_specs_dir()}")
    return spec


class RewindRequest(BaseModel):
    batch_id: int = Field(ge=0, description="The committed batch to restore the state to (0 empties it).")
    rewind_only: bool = Field(True, description="Rewind and stop; the next run processes from there.")


def _token(request: Request, credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials and credentials.scheme.lower() == "bearer":
        return credentials.credentials
    return request.cookies.get(COOKIE_NAME_JWT_TOKEN, "")


def _ledger_rows(spec: PipelineSpec, limit: int) -> list[dict[str, Any]]:
    """The newest ledger rows as `history --json` has them, each marked live
    (a committed row of the current lineage) with the rewind that cut it."""
    from spark_jobs.core.ledger import RowStatus

    rows, live = inspect.recent_in_lineage(spec, limit)
    return [
        {
            **r.to_dict(),
            "live": r.status is RowStatus.COMMITTED and live.holds(r.epoch, r.batch_id),
            "rewound_in_epoch": None if r.status is RowStatus.REWOUND else live.cut_by(r.epoch, r.batch_id),
        }
        for r in rows
    ]


async def _resolve_pending(client: httpx.AsyncClient, spec: PipelineSpec, views: list[dict[str, Any]]) -> None:
    """A planned, uncommitted batch is being run now or was left by a crash:
    its run's state in Airflow tells which (`run_state`, `in_flight`)."""
    for view in views:
        if view["phase"] != "pending":
            continue
        view["run_state"], view["in_flight"] = None, None
        if not view.get("run_id"):
            continue
        try:
            answer = await client.get(f"/api/v2/dags/{spec.name}/dagRuns/{view['run_id']}")
        except httpx.HTTPError:
            continue
        if answer.status_code == 200:
            view["run_state"] = answer.json().get("state")
            view["in_flight"] = view["run_state"] in ("queued", "running")
        elif answer.status_code == 404:
            view["run_state"] = "not an Airflow run"  # the CLI's: no orchestrator to ask


async def _link_downstream(client: httpx.AsyncClient, spec: PipelineSpec, views: list[dict[str, Any]]) -> None:
    """The DAG runs each committed batch's asset event triggered
    (`downstream_runs`), from the DAG's 100 newest events (Airflow's
    default page limit); None where Airflow could not say or the event is older."""
    runs = {v["run_id"] for v in views if v["phase"] == "committed" and v.get("run_id")}
    for view in views:
        view["downstream_runs"] = None
    if not runs:
        return
    try:
        answer = await client.get("/api/v2/assets/events", params={"source_dag_id": spec.name, "order_by": "-timestamp", "limit": 100})
    except httpx.HTTPError:
        return
    if answer.status_code != 200:
        return
    made: dict[tuple[str | None, int | None, int | None], list[dict[str, Any]]] = {}
    for event in answer.json().get("asset_events", []):
        extra = event.get("extra") or {}
        key = (event.get("source_run_id"), extra.get("epoch"), extra.get("batch_id"))
        made.setdefault(key, []).extend(
            {"dag_id": r["dag_id"], "run_id": r["run_id"], "state": r.get("state")} for r in event.get("created_dagruns", [])
        )
    for view in views:
        if view["phase"] == "committed":
            # None, not []: an event older than the 100 newest is not looked for.
            view["downstream_runs"] = made.get((view.get("run_id"), view["epoch"], view["batch_id"]))


def create_app() -> FastAPI:
    app = FastAPI(title="Micro-batch console", docs_url=None, redoc_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.state.probes = Probes(_summary, mark=ledger_mark)
    app.include_router(router)
    return app


#: The console's page and its JSON API (`create_app` serves them).
router = APIRouter()


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page(request: Request) -> HTMLResponse:
    try:
        await get_user(request, None, await bearer_scheme(request))
    except HTTPException as exc:
        login = get_auth_manager().get_url_login(next_url=str(request.url))
        return HTMLResponse(
            f'<p>Log in to Airflow to see the micro-batch console: <a href="{html.escape(login)}">log in</a>.</p>',
            status_code=exc.status_code,
        )
    return HTMLResponse((STATIC / "index.html").read_text())

@router.get("/api/pipelines")
async def pipelines(request: Request, user: User) -> list[dict[str, Any]]:
    probes: Probes = request.app.state.probes
    scan = await anyio.to_thread.run_sync(_SPECS.scan)
    specs = scan.specs
    probes.forget_all_but(specs.values())
    visible = [spec for spec in specs.values() if _allowed(user, "GET", spec.name)]
    results = await probes.summaries(visible)
    _waiting_for_upstreams(results, specs)
    await _mark_paused(request, results)
    for result in results:
        # A spec broken since its last valid version keeps its DAG: its
        # position and batches (read with that version) show, and the error.
        problem = scan.broken.get(result["name"])
        if problem is not None:
            result["status"] = "broken"
            result["problems"] = [f"runs fail until the spec is fixed: {problem}", *(result.get("problems") or [])]
    kept = {Path(specs[name].spec_path) for name in scan.broken}
    if _allowed(user, "GET", None):
        # A spec that never loaded has no DAG: shown to those who may read every DAG.
        for path, message in scan.errors.items():
            if path.resolve() not in kept:
                results.append({"name": path.stem, "dag_id": None, "status": "broken", "spec_path": str(path), "problems": [message]})
    return results

def _waiting_for_upstreams(results: list[dict[str, Any]], specs: dict[str, PipelineSpec]) -> None:
    """A pipeline whose Delta source is another pipeline's state, which has
    no table yet, is waiting for that pipeline's first batch, not broken."""
    by_state = {spec.state_path.rstrip("/"): spec.name for spec in specs.values()}
    for result in results:
        spec = specs.get(result["name"])
        if spec is None or spec.source.type != "delta" or result.get("status") not in ("problem", "waiting"):
            continue
        upstream = by_state.get(spec.source_path.rstrip("/"))
        if upstream is not None and any("not a Delta table" in p for p in result.get("problems") or []):
            result["status"] = "waiting"
            result["problems"] = [f"waiting for {upstream}'s first batch: its state table, this pipeline's source, does not exist yet"]


async def _mark_paused(request: Request, results: list[dict[str, Any]]) -> None:
    """Each pipeline's DAG paused or not (`paused`; None where Airflow did not
    say), asked of Airflow's REST API as the caller: a paused DAG is why a
    pipeline with data waiting runs no batch."""
    for result in results:
        result["paused"] = None
    token = _token(request, await bearer_scheme(request))
    paused: dict[str, bool] = {}
    try:
        async with httpx.AsyncClient(base_url=airflow_root(), timeout=10, headers={"Authorization": f"Bearer {token}"}) as client:
            while True:  # pages of Airflow's page limit ([api] maximum_page_limit, 100 by default)
                answer = await client.get("/api/v2/dags", params={"tags": "microbatch", "limit": 100, "offset": len(paused)})
                if answer.status_code != 200:
                    break
                page = answer.json()
                paused.update({dag["dag_id"]: dag.get("is_paused") for dag in page.get("dags", [])})
                if not page.get("dags") or len(paused) >= page.get("total_entries", 0):
                    break
    except httpx.HTTPError:
        pass
    for result in results:
        result["paused"] = paused.get(result.get("dag_id"))


@router.get("/api/pipelines/{name}/batches")
async def batches(
    name: str,
    request: Request,
    user: User,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    group: Literal["row", "batch"] = "row",
) -> list[dict[str, Any]]:
    spec = await _spec(name, user)
    if group == "row":
        return await anyio.to_thread.run_sync(_ledger_rows, spec, limit)
    views = [v.to_dict() for v in await anyio.to_thread.run_sync(inspect.batches, spec, limit)]
    token = _token(request, await bearer_scheme(request))
    async with httpx.AsyncClient(base_url=airflow_root(), timeout=10, headers={"Authorization": f"Bearer {token}"}) as client:
        await _resolve_pending(client, spec, views)
        await _link_downstream(client, spec, views)
    return views

@router.get("/api/pipelines/{name}/runs/{run_id}")
async def run_state(name: str, run_id: str, request: Request, user: User) -> dict[str, Any]:
    """A run of the pipeline's DAG as Airflow has it (its state), asked as
    the caller: the page follows the run a rewind triggered until it ends."""
    spec = await _spec(name, user)
    token = _token(request, await bearer_scheme(request))
    async with httpx.AsyncClient(base_url=airflow_root(), timeout=10, headers={"Authorization": f"Bearer {token}"}) as client:
        answer = await client.get(f"/api/v2/dags/{spec.name}/dagRuns/{quote(run_id, safe='')}")
        dag = await client.get(f"/api/v2/dags/{spec.name}")
    if answer.status_code != 200:
        raise HTTPException(answer.status_code, f"Airflow answered {answer.status_code} for run {run_id} of {spec.name}")
    run = answer.json()
    # A queued run of a paused DAG waits until someone unpauses it: the page says so.
    paused = dag.json().get("is_paused") if dag.status_code == 200 else None
    return {"dag_id": spec.name, "run_id": run_id, "state": run.get("state"), "note": run.get("note"), "dag_paused": paused}


@router.post("/api/pipelines/{name}/unpause")
async def unpause(name: str, request: Request, user: User) -> JSONResponse:
    """Unpause the pipeline's DAG (Airflow's own switch, through its REST
    API as the caller): a rewind's run waits while its DAG is paused."""
    spec = await _spec(name, user, "PUT")
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.patch(
            f"{airflow_root()}/api/v2/dags/{spec.name}",
            json={"is_paused": False},
            headers={"Authorization": f"Bearer {_token(request, await bearer_scheme(request))}"},
        )
    try:
        content = answer.json()
    except ValueError:
        content = {"detail": answer.text[:500]}
    return JSONResponse(content, status_code=answer.status_code)

@router.get("/api/pipelines/{name}/quarantine", response_model=None)
async def quarantine(
    name: str,
    user: User,
    batch_id: Annotated[int | None, Query(ge=0)] = None,
    epoch: Annotated[int | None, Query(ge=0)] = None,
    reason: str | None = None,
    lineage: Literal["live", "all"] = "live",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    format: Literal["json", "csv"] = "json",  # noqa: A002 - the query parameter's name
) -> dict[str, Any] | Response:
    spec = await _spec(name, user)
    found = await anyio.to_thread.run_sync(
        lambda: inspect.quarantined(
            spec, batch_id=batch_id, epoch=epoch, reason=reason, lineage=lineage, limit=None if format == "csv" else limit
        )
    )
    if format == "json":
        return found.to_dict()
    return _as_csv(found.rows, f"{spec.name}-quarantine" + (f"-batch-{batch_id}" if batch_id is not None else ""))

@router.post("/api/pipelines/{name}/rewind")
async def rewind(name: str, body: RewindRequest, request: Request, user: User) -> JSONResponse:
    spec = await _spec(name, user, "POST", DagAccessEntity.RUN)
    try:
        # The job's own rules, asked before a run is made for nothing.
        await anyio.to_thread.run_sync(check_rewind, spec, body.batch_id)
    except RewindError as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
    who = getattr(user, "get_name", lambda: "a user")()
    payload = {
        "logical_date": None,
        "conf": {"rewind_to_batch": body.batch_id, "rewind_only": body.rewind_only},
        "note": f"Rewind to batch {body.batch_id} requested by {who} from the micro-batch console.",
    }
    # Through Airflow's REST API, as the caller: Airflow checks the right
    # to trigger again, records who did it, and validates the params.
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.post(
            f"{airflow_root()}/api/v2/dags/{spec.name}/dagRuns",
            json=payload,
            headers={"Authorization": f"Bearer {_token(request, await bearer_scheme(request))}"},
        )
    try:
        content = answer.json()
    except ValueError:
        content = {"detail": answer.text[:500]}
    return JSONResponse(content, status_code=answer.status_code)


def _as_csv(rows: list[dict[str, Any]], name: str) -> Response:
    """Quarantined records as a CSV download named `name`.csv."""
    out = io.StringIO()
    columns = ["epoch", "batch_id", "file", "line", "reason", "raw", "quarantined_at"]
    writer = csv.DictWriter(out, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return Response(out.getvalue(), media_type="text/csv", headers={"Content-Disposition": f'attachment; filename="{name}.csv"'})
