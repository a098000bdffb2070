-- Argo CD action discovery for kuberl.io/RLExperiment: which actions the UI offers.
-- suspend: checkpoint, then scale every role to zero (spec.suspend=true); resume undoes it.
-- A finished experiment (Succeeded/Failed) offers neither.
local actions = {}
local suspended = obj.spec ~= nil and obj.spec.suspend == true
local finished = obj.status ~= nil and (obj.status.phase == "Succeeded" or obj.status.phase == "Failed")
actions["suspend"] = {["disabled"] = suspended or finished, ["iconClass"] = "fa fa-fw fa-pause"}
actions["resume"] = {["disabled"] = (not suspended) or finished, ["iconClass"] = "fa fa-fw fa-play"}
return actions
