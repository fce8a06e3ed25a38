"""A minimal MLflow tracking server on 127.0.0.1: the REST endpoints MLflow's client calls for one
run (experiments get-by-name and create, runs search, create, update, log-batch, set-tag, get), with
its runs kept in memory so a test reads back what arrived. The installed mlflow-skinny has no
server of its own (mlflow.server needs Flask).

`hold` makes the server keep each request waiting, unanswered, until the test sets it: a tracking
server that answers slowly, for exactly as long as the test needs.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

API = "/api/2.0/mlflow/"


class MlflowServer:
    def __init__(self, hold: threading.Event | None = None):
        self.hold = hold  # None: answer at once; else each request waits until it is set
        self.requests: list[str] = []  # endpoint of every request received, in order
        self.received = threading.Event()  # set by the first request
        self.experiments: dict[str, str] = {}  # name -> id
        self.runs: dict[str, dict] = {}  # id -> {"status", "tags", "metrics": [(key, step, value)]}
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> MlflowServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.hold is not None:
            self.hold.set()  # a held request answers (to a client perhaps gone), its thread ends
        self._http.shutdown()
        self._http.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self._answer({k: v[0] for k, v in parse_qs(urlparse(self.path).query).items()})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length) or b"{}"))

            def _answer(self, body: dict) -> None:
                endpoint = urlparse(self.path).path.removeprefix(API)
                with server._lock:
                    server.requests.append(endpoint)
                server.received.set()
                if server.hold is not None:
                    server.hold.wait()
                with server._lock:
                    status, reply = server.answer(endpoint, body)
                data = json.dumps(reply).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up waiting
                    pass

            def log_message(self, *args):  # quiet
                pass

        return Handler

    def answer(self, endpoint: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON reply) of one request."""
        one = body
        if endpoint == "experiments/get-by-name":
            if one["experiment_name"] not in self.experiments:
                return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"}
            return 200, {"experiment": self._experiment(one["experiment_name"])}
        if endpoint == "experiments/create":
            self.experiments[one["name"]] = str(len(self.experiments) + 1)
            return 200, {"experiment_id": self.experiments[one["name"]]}
        if endpoint == "runs/search":
            return 200, {"runs": []}  # every test starts one new run
        if endpoint == "runs/create":
            run_id = uuid.uuid4().hex
            tags = {t["key"]: t["value"] for t in one.get("tags", [])}
            self.runs[run_id] = {"status": "RUNNING", "tags": tags, "metrics": [],
                                 "experiment_id": one["experiment_id"]}
            return 200, {"run": {"info": self._info(run_id), "data": {}}}
        if endpoint == "runs/log-batch":
            run = self.runs[one["run_id"]]
            run["metrics"] += [(m["key"], int(m["step"]), float(m["value"])) for m in one.get("metrics", [])]
            run["tags"].update({t["key"]: t["value"] for t in one.get("tags", [])})
            return 200, {}
        if endpoint == "runs/set-tag":
            self.runs[one["run_id"]]["tags"][one["key"]] = one["value"]
            return 200, {}
        if endpoint == "runs/get":
            return 200, {"run": {"info": self._info(one["run_id"]), "data": {}}}
        if endpoint == "runs/update":
            self.runs[one["run_id"]]["status"] = one["status"]
            return 200, {"run_info": self._info(one["run_id"])}
        return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"no endpoint {endpoint}"}

    def _experiment(self, name: str) -> dict:
        return {"experiment_id": self.experiments[name], "name": name, "lifecycle_stage": "active",
                "artifact_location": "mlflow-artifacts:/x"}

    def _info(self, run_id: str) -> dict:
        run = self.runs[run_id]
        return {"run_id": run_id, "run_uuid": run_id, "experiment_id": run["experiment_id"],
                "status": run["status"], "lifecycle_stage": "active", "start_time": 0,
                "artifact_uri": "mlflow-artifacts:/x"}
