"""The Argo CD integration in examples/argocd, checked the way Argo CD itself checks it.

- resource_customizations/kuberl.io/RLExperiment/ is laid out as in argoproj/argo-cd's
  resource_customizations/ (health.lua + health_test.yaml + testdata/, actions/discovery.lua,
  actions/<name>/action.lua, actions/action_test.yaml + actions/testdata/). Every case in
  health_test.yaml and action_test.yaml is a pytest case here, run as Argo CD's util/lua runs it
  (TestLuaHealthScript, TestLuaResourceActionsScript).
- The Lua runs in Lua 5.1 (lupa.lua51; Argo CD embeds gopher-lua, a Lua 5.1 VM) inside a sandbox
  copied from argo-cd util/lua/lua.go `runLua`: only the base, package and table libraries and the
  "safe" os module (os.time/os.date, reachable only through require("os")); no string, math, io,
  debug or coroutine library, and no string methods; `obj` is the live object as a global; the
  script's return value is read back through JSON as gopher-json encodes it; a 1 s deadline.
  That is the sandbox of a script installed through argocd-cm without
  resource.customizations.useOpenLibs, the strictest one, so Lua that fails there fails here.
- argocd-cm.yaml carries byte-identical copies of those scripts under the keys Argo CD reads.
- The Applications are admitted by a real kube-apiserver serving the upstream Application CRD, unknown
  fields rejected: tests/integration/test_argocd_admission.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lupa.lua51 as lua51  # kuberl[test]: a missing install fails here, it is not skipped
import pytest
import yaml

from kuberl.api import RLExperiment, load_experiment

ROOT = Path(__file__).resolve().parents[2]
ARGOCD = ROOT / "examples" / "argocd"
CUSTOM = ARGOCD / "resource_customizations" / "kuberl.io" / "RLExperiment"
ACTIONS = CUSTOM / "actions"
GROUP_KIND = "kuberl.io/RLExperiment"

# gitops-engine pkg/health HealthStatusCode values (isValidHealthStatusCode in util/lua/lua.go)
ARGO_HEALTH = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}
INVALID_HEALTH = "Lua returned an invalid health status"


# ---------------------------------------------------------------------------------------------
# Argo CD's Lua VM (util/lua/lua.go), in Lua 5.1
# ---------------------------------------------------------------------------------------------


class LuaScriptError(Exception):
    """What Argo CD reports as an error of the script (it shows no health / fails the action)."""


# gopher-lua OpenBase + OpenPackage + OpenTable; Argo's OpenSafeOs (oslib_safe.go) registers
# os.time/os.date into the `table` module (it passes lua.TabLibName), and preloads them as "os".
_SANDBOX = r"""
local real_G, deadline_s = ...
local base = {"assert", "collectgarbage", "dofile", "error", "getfenv", "getmetatable", "ipairs",
  "load", "loadfile", "loadstring", "module", "next", "newproxy", "pairs", "pcall", "print", "rawequal",
  "rawget", "rawset", "select", "setfenv", "setmetatable", "tonumber", "tostring", "type", "unpack",
  "xpcall", "_VERSION"}
local env = {}
for _, name in ipairs(base) do env[name] = real_G[name] end
env._G = env
local safe_os = {time = real_G.os.time, date = real_G.os.date}
local tbl = {}
for k, v in real_G.pairs(real_G.table) do tbl[k] = v end
tbl.time, tbl.date = safe_os.time, safe_os.date
env.table = tbl
local loaded = {_G = env, table = tbl, package = nil}
local preload = {os = function() return {time = safe_os.time, date = safe_os.date} end}
env.package = {loaded = loaded, preload = preload, path = "", cpath = "", loaders = {}}
loaded.package = env.package
env.require = function(name)
  if loaded[name] ~= nil then return loaded[name] end
  local loader = preload[name]
  if loader == nil then real_G.error("module " .. real_G.tostring(name) .. " not found", 2) end
  loaded[name] = loader(name)
  return loaded[name]
end
-- No string library: gopher-lua without OpenString gives strings no methods either.
real_G.debug.setmetatable("", nil)
-- context.WithTimeout(1 s) around DoString: abort a script that runs too long.
local clock, started = real_G.os.clock, real_G.os.clock()
real_G.debug.sethook(function()
  if clock() - started > deadline_s then real_G.error("context deadline exceeded", 2) end
end, "", 1000)
return env
"""


# loadstring + setfenv + pcall, always two results (lupa turns a single one into a bare value).
_CALL = r"""
function(script, chunkname, env)
  local chunk, err = loadstring(script, chunkname)
  if chunk == nil then return false, err end
  setfenv(chunk, env)
  local ok, result = pcall(chunk)
  debug.sethook()
  return ok, result
end
"""


def _encode(value, visited: set, ident) -> object:
    """A Lua value as layeh.com/gopher-json Encode turns it into JSON (then decoded again).
    `ident` names a table (Lua's tostring: "table: 0x..."); lupa wraps a table anew at each access."""
    kind = lua51.lua_type(value)
    if kind is None:  # a Python value: nil, boolean, number, string
        if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            raise LuaScriptError(f"json: unsupported value: {value}")
        return value
    if kind != "table":
        raise LuaScriptError(f"cannot encode {kind} to JSON")
    if ident(value) in visited:  # gopher-json never forgets a table: a table used twice is an error too
        raise LuaScriptError("cannot encode recursively nested tables to JSON")
    visited.add(ident(value))
    items = list(value.items())
    if not items:
        return []  # an empty table is an empty array (cleanReturnedObj repairs objects)
    keys = [k for k, _ in items]
    if all(isinstance(k, (int, float)) and not isinstance(k, bool) for k in keys):
        if sorted(keys) != list(range(1, len(keys) + 1)):
            raise LuaScriptError("cannot encode sparse array")
        return [_encode(v, visited, ident) for _, v in sorted(items, key=lambda kv: kv[0])]
    if all(isinstance(k, str) for k in keys):
        return {k: _encode(v, visited, ident) for k, v in items}
    raise LuaScriptError("cannot encode mixed or invalid key types")


def _clean_returned(new, old):
    """util/lua/lua.go cleanReturnedObj/cleanReturnedArray: an empty array where the input had an object
    becomes that object again (Lua cannot tell {} from [])."""
    if isinstance(new, dict) and isinstance(old, dict):
        for key, old_value in old.items():
            if key not in new:
                continue
            new_value = new[key]
            if isinstance(new_value, dict) and isinstance(old_value, dict):
                new[key] = _clean_returned(new_value, old_value)
            elif isinstance(new_value, list) and isinstance(old_value, dict) and not new_value:
                new[key] = old_value
            elif isinstance(new_value, list) and isinstance(old_value, list):
                new[key] = _clean_returned(new_value, old_value)
    elif isinstance(new, list) and isinstance(old, list):
        for i, new_value in enumerate(new):
            if i < len(old) and isinstance(new_value, (dict, list)) and type(new_value) is type(old[i]):
                new[i] = _clean_returned(new_value, old[i])
    return new


def run_lua(script: str, obj: dict, chunkname: str = "script"):
    """runLua: a fresh VM, `obj` as a global, the script run as a chunk; its (first) return value,
    encoded to JSON as Argo CD does. Raises LuaScriptError where Argo CD's DoString/Encode fails."""
    obj = json.loads(json.dumps(obj))  # the object as Argo CD has it: JSON (unstructured.Unstructured)
    lua = lua51.LuaRuntime(register_eval=False, register_builtins=False, unpack_returned_tuples=False)
    env = lua.execute(_SANDBOX, lua.globals(), 1.0)
    env["obj"] = lua.table_from(obj, recursive=True)
    ok, result = lua.eval(_CALL)(script, "=" + chunkname, env)
    if not ok:
        raise LuaScriptError(result)
    return _encode(result, set(), lua.globals().tostring)


def health(obj: dict, script: str | None = None) -> dict:
    """ExecuteHealthLua: {status, message} (gitops-engine HealthStatus)."""
    result = run_lua(script if script is not None else (CUSTOM / "health.lua").read_text(), obj, "health.lua")
    if result is None or result == []:
        return {"status": "", "message": ""}
    if not isinstance(result, dict):
        raise LuaScriptError(f"expect table output from Lua script, not {type(result).__name__}")
    status = {"status": result.get("status", ""), "message": result.get("message", "")}
    for key, value in status.items():
        if not isinstance(value, str):
            raise LuaScriptError(f"json: cannot unmarshal {type(value).__name__} into HealthStatus.{key} of type string")
    if status["status"] not in ARGO_HEALTH:
        return {"status": "Unknown", "message": INVALID_HEALTH}
    return status


def discover(obj: dict, script: str | None = None) -> list[dict]:
    """ExecuteResourceActionDiscovery: the actions as appv1.ResourceAction (name, disabled, iconClass,
    displayName, params), omitting empty fields as their JSON tags do."""
    result = run_lua(script if script is not None else (ACTIONS / "discovery.lua").read_text(), obj, "discovery.lua")
    if result == []:
        return []
    if not isinstance(result, dict):
        raise LuaScriptError("expect table output from Lua script")
    actions = []
    for name, value in result.items():
        action = {"name": name, "disabled": False}
        if isinstance(value, dict):
            action["disabled"] = value.get("disabled", False) is True
            action.update({k: value[k] for k in ("iconClass", "displayName", "params") if value.get(k)})
        actions.append(action)
    return sorted(actions, key=lambda a: a["name"])


def run_action(name: str, obj: dict) -> list[dict]:
    """ExecuteResourceAction: the impacted resources as [{"operation", "unstructuredObj"}]. An object
    returned (old-style action) is a patch of the source object."""
    result = run_lua((ACTIONS / name / "action.lua").read_text(), obj, f"{name}/action.lua")
    if isinstance(result, list) and result:
        return [{"operation": r["operation"], "unstructuredObj": _clean_returned(r["unstructuredObj"], obj)
                 if r["operation"] == "patch" else r["unstructuredObj"]} for r in result]
    if not isinstance(result, dict):
        raise LuaScriptError("expect table output from Lua script")
    return [{"operation": "patch", "unstructuredObj": _clean_returned(result, copy.deepcopy(obj))}]


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


# ---------------------------------------------------------------------------------------------
# The sandbox behaves as Argo CD's
# ---------------------------------------------------------------------------------------------


class TestSandbox:
    OBJ = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}}

    @pytest.mark.parametrize("snippet", [
        'return {status = string.upper("healthy")}',     # no string library
        'return {status = ("Healthy"):lower()}',          # strings have no methods
        "return {status = math.floor(1)}",                 # no math library
        'io.write("x")',                                    # no io
        'os.execute("true")',                               # no global os
        'require("os").execute("true")',                   # the safe os has time and date only
        'require("string")',                                # nothing else to require
        "debug.getinfo(1)",                                 # no debug
        "while true do end",                                # the 1 s deadline
        "local t = {}; return {a = t, b = t}",              # gopher-json: a table encoded twice
        "return {[1] = 'a', [3] = 'b'}",                    # gopher-json: sparse array
        "return {1, x = 2}",                                # gopher-json: mixed keys
    ])
    def test_what_fails_in_argo_cd_fails_here(self, snippet):
        with pytest.raises(LuaScriptError):
            run_lua(snippet, self.OBJ)

    def test_what_argo_cd_offers_works(self):
        script = """
        local os = require("os")
        local t = {}
        table.insert(t, "b"); table.insert(t, "a"); table.sort(t)
        return {joined = table.concat(t, ","), n = #obj.metadata.name, year = os.date("*t").year > 2000,
                typ = type(obj.data), s = tostring(1) .. "/" .. tostring(0.5), ok = pcall(error, "x") == false}
        """
        result = run_lua(script, self.OBJ)
        assert result == {"joined": "a,b", "n": 1, "year": True, "typ": "table", "s": "1/0.5", "ok": True}

    def test_lua_5_1(self):
        assert run_lua("return _VERSION", self.OBJ) == "Lua 5.1"

    def test_an_empty_object_survives_an_action_and_an_invalid_status_is_unknown(self):
        after = run_lua("obj.metadata.labels = {a = 'b'}; return obj", self.OBJ)
        assert after["data"] == []  # as gopher-json encodes it; cleanReturnedObj repairs it
        assert _clean_returned(after, self.OBJ)["data"] == {}
        assert health(self.OBJ, 'return {status = "Great"}') == {"status": "Unknown", "message": INVALID_HEALTH}


# ---------------------------------------------------------------------------------------------
# resource_customizations/kuberl.io/RLExperiment: Argo CD's test files, case by case
# ---------------------------------------------------------------------------------------------

HEALTH_TESTS = load_yaml(CUSTOM / "health_test.yaml")["tests"]
ACTION_TESTS = load_yaml(ACTIONS / "action_test.yaml")
TESTDATA = sorted(CUSTOM.glob("testdata/*.yaml")) + sorted(ACTIONS.glob("testdata/*.yaml"))


def test_the_layout_is_argo_cds():
    files = {p.relative_to(CUSTOM).as_posix() for p in CUSTOM.rglob("*") if p.is_file()}
    scripts = {f for f in files if f.endswith(".lua")}
    assert scripts == {"health.lua", "actions/discovery.lua", "actions/suspend/action.lua", "actions/resume/action.lua"}
    assert {"health_test.yaml", "actions/action_test.yaml"} <= files
    assert files - scripts - {"health_test.yaml", "actions/action_test.yaml"} == \
        {p.relative_to(CUSTOM).as_posix() for p in TESTDATA}
    assert set(load_yaml(CUSTOM / "health_test.yaml")) == {"tests"}
    assert set(ACTION_TESTS) == {"discoveryTests", "actionTests"}


@pytest.mark.parametrize("path", TESTDATA, ids=lambda p: p.relative_to(CUSTOM).as_posix())
def test_every_testdata_file_is_a_valid_rlexperiment(path):
    doc = load_yaml(path)
    assert (doc["apiVersion"], doc["kind"]) == ("kuberl.io/v1alpha1", "RLExperiment")
    RLExperiment.model_validate(doc)


def test_every_health_testdata_file_has_a_case_and_every_status_is_covered():
    assert {t["inputPath"] for t in HEALTH_TESTS} == {p.relative_to(CUSTOM).as_posix() for p in CUSTOM.glob("testdata/*.yaml")}
    assert {t["healthStatus"]["status"] for t in HEALTH_TESTS} == {"Healthy", "Progressing", "Degraded", "Suspended"}


@pytest.mark.parametrize("case", HEALTH_TESTS, ids=[t["inputPath"] for t in HEALTH_TESTS])
def test_health(case):
    """TestLuaHealthScript: assert.Equal(test.HealthStatus, result): status and message, exactly."""
    assert set(case) == {"healthStatus", "inputPath"} and set(case["healthStatus"]) <= {"status", "message"}
    expected = {"status": case["healthStatus"]["status"], "message": case["healthStatus"].get("message", "")}
    assert health(load_yaml(CUSTOM / case["inputPath"])) == expected


@pytest.mark.parametrize("case", ACTION_TESTS["discoveryTests"], ids=[t["inputPath"] for t in ACTION_TESTS["discoveryTests"]])
def test_action_discovery(case):
    """TestLuaResourceActionsScript, discovery: Argo asserts each discovered action is in `result`;
    here the two lists must be equal (an action missing from `result` fails too)."""
    expected = sorted(({"disabled": False, **a} for a in case["result"]), key=lambda a: a["name"])
    assert discover(load_yaml(ACTIONS / case["inputPath"])) == expected


@pytest.mark.parametrize("case", ACTION_TESTS["actionTests"],
                         ids=[f"{t['action']}/{t['inputPath']}" for t in ACTION_TESTS["actionTests"]])
def test_action(case):
    """TestLuaResourceActionsScript, actions: each impacted resource equals its expected object; a
    patch keeps the source's group/kind/name/namespace."""
    source = load_yaml(ACTIONS / case["inputPath"])
    expected_doc = load_yaml(ACTIONS / case["expectedOutputPath"])
    expected = [e["unstructuredObj"] for e in expected_doc] if isinstance(expected_doc, list) else [expected_doc]
    impacted = run_action(case["action"], source)
    assert len(impacted) == len(expected)
    for resource, want in zip(impacted, expected):
        got = resource["unstructuredObj"]
        if resource["operation"] == "patch":
            for key in ("apiVersion", "kind"):
                assert got[key] == source[key]
            assert (got["metadata"]["name"], got["metadata"].get("namespace")) == \
                (source["metadata"]["name"], source["metadata"].get("namespace"))
        assert got == json.loads(json.dumps(want))


@pytest.mark.parametrize("case", ACTION_TESTS["actionTests"],
                         ids=[f"{t['action']}/{t['inputPath']}" for t in ACTION_TESTS["actionTests"]])
def test_actions_change_only_spec_suspend(case):
    """What the testdata pairs say, spelled out: suspend/resume set spec.suspend and nothing else."""
    source = load_yaml(ACTIONS / case["inputPath"])
    expected = load_yaml(ACTIONS / case["expectedOutputPath"])
    changed = copy.deepcopy(source)
    changed["spec"]["suspend"] = {"suspend": True, "resume": False}[case["action"]]
    assert expected == changed


def test_every_action_has_a_test_and_discovery_names_exactly_the_defined_actions():
    defined = {p.name for p in ACTIONS.iterdir() if (p / "action.lua").is_file()}
    assert {t["action"] for t in ACTION_TESTS["actionTests"]} == defined
    for case in ACTION_TESTS["discoveryTests"]:
        assert {a["name"] for a in case["result"]} == defined


def test_a_finished_experiment_offers_no_action():
    for case in ACTION_TESTS["discoveryTests"]:
        phase = (load_yaml(ACTIONS / case["inputPath"]).get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            assert all(a["disabled"] for a in case["result"]), case


class TestHealthRules:
    """Rules the testdata does not show on its own (variations of one status dump)."""

    def obj(self, name: str) -> dict:
        return load_yaml(CUSTOM / "testdata" / f"{name}.yaml")

    def test_the_failed_condition_wins_over_a_running_phase(self):
        obj = self.obj("running-ready")
        obj["status"]["conditions"].append({"type": "Failed", "status": "True", "reason": "BusLost", "message": "bus unreachable"})
        assert health(obj) == {"status": "Degraded", "message": "bus unreachable (step 42/150, reward 0.612)"}

    def test_a_degraded_condition_that_is_false_does_not_degrade(self):
        obj = self.obj("running-ready")
        obj["status"]["conditions"].append({"type": "Degraded", "status": "False", "reason": "AllReplicasReady"})
        assert health(obj)["status"] == "Healthy"

    def test_running_without_any_ready_condition_is_progressing(self):
        obj = self.obj("running-ready")
        obj["status"]["conditions"] = [c for c in obj["status"]["conditions"] if c["type"] != "Ready"]
        assert health(obj)["status"] == "Progressing"

    def test_a_message_falls_back_to_the_reason(self):
        obj = self.obj("failed")
        for c in obj["status"]["conditions"]:
            c["message"] = ""
        assert health(obj)["message"].startswith("MaxRestartsExceeded")

    def test_an_unknown_phase_is_unknown_not_healthy(self):
        obj = self.obj("running-ready")
        obj["status"]["phase"] = "Exploding"
        assert health(obj) == {"status": "Unknown", "message": "Unknown phase Exploding"}

    def test_numbers_print_as_gopher_lua_prints_them(self):
        obj = self.obj("running-ready")
        obj["status"]["progress"] = {"step": 42}
        assert health(obj)["message"].endswith("(step 42)")


# ---------------------------------------------------------------------------------------------
# argocd-cm.yaml: the keys Argo CD reads, the scripts byte for byte
# ---------------------------------------------------------------------------------------------


def override_key(cm_key: str) -> tuple[str, str] | None:
    """(customization type, group/kind) of an argocd-cm key, parsed as Argo CD's util/settings
    appendResourceOverridesFromSplitKeys + convertToOverrideKey parse it; None if Argo CD skips it."""
    if not cm_key.startswith("resource.customizations"):
        return None
    parts = cm_key.split(".", 3)
    if len(parts) < 4:
        return None
    group_kind = parts[3].split("_")
    if len(group_kind) == 2:
        return parts[2], "/".join(group_kind)
    if len(group_kind) == 1 and parts[3]:
        return parts[2], parts[3]
    raise ValueError(f"group kind should be in format `resource.customizations.<type>.<group_kind>`, got {parts[3]!r}")


class TestArgoCDConfigMap:
    HEALTH = "resource.customizations.health.kuberl.io_RLExperiment"
    ACTIONS = "resource.customizations.actions.kuberl.io_RLExperiment"

    def data(self) -> dict:
        cm = load_yaml(ARGOCD / "argocd-cm.yaml")
        assert (cm["apiVersion"], cm["kind"], cm["metadata"]["name"], cm["metadata"]["namespace"]) == \
            ("v1", "ConfigMap", "argocd-cm", "argocd")
        assert cm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "argocd"  # Argo CD watches only these
        return cm["data"]

    def test_exactly_the_health_and_actions_keys_of_the_rlexperiment_kind(self):
        data = self.data()
        assert set(data) == {self.HEALTH, self.ACTIONS}
        assert {override_key(k) for k in data} == {("health", GROUP_KIND), ("actions", GROUP_KIND)}

    def test_health_script_is_health_lua_byte_for_byte(self):
        assert self.data()[self.HEALTH] == (CUSTOM / "health.lua").read_text()

    def test_actions_are_the_action_files_byte_for_byte(self):
        actions = yaml.safe_load(self.data()[self.ACTIONS])
        # appv1.ResourceActions: discovery.lua, definitions [{name, action.lua}], mergeBuiltinActions
        assert set(actions) == {"discovery.lua", "definitions"}
        assert actions["discovery.lua"] == (ACTIONS / "discovery.lua").read_text()
        assert [set(d) for d in actions["definitions"]] == [{"name", "action.lua"}] * len(actions["definitions"])
        defs = {d["name"]: d["action.lua"] for d in actions["definitions"]}
        assert defs == {p.name: (p / "action.lua").read_text() for p in ACTIONS.iterdir() if (p / "action.lua").is_file()}


class TestApplications:
    def test_experiment_application_syncs_a_valid_experiment_from_this_repository(self):
        app = load_yaml(ARGOCD / "application.yaml")
        src = app["spec"]["source"]
        manifest = ROOT / src["path"] / src["directory"]["include"]
        assert manifest.exists(), manifest
        load_experiment(manifest)

    def test_fields_others_change_at_run_time_are_ignored_and_exist_in_the_crd(self):
        app = load_yaml(ARGOCD / "application.yaml")
        crd = load_yaml(ROOT / "crds" / "kuberl.io_rlexperiments.yaml")
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        (ignore,) = [i for i in app["spec"]["ignoreDifferences"] if i["kind"] == "RLExperiment"]
        assert ignore["group"] == "kuberl.io"
        assert set(ignore["jsonPointers"]) == {"/spec/rollout/replicas", "/spec/suspend"}
        for pointer in ignore["jsonPointers"]:
            node = schema
            for part in pointer.strip("/").split("/"):
                node = node["properties"][part]
        assert "RespectIgnoreDifferences=true" in app["spec"]["syncPolicy"]["syncOptions"]

    def test_operator_application_installs_the_chart_in_this_repository(self):
        app = load_yaml(ARGOCD / "operator-application.yaml")
        chart = ROOT / app["spec"]["source"]["path"]
        assert (chart / "Chart.yaml").exists()
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
