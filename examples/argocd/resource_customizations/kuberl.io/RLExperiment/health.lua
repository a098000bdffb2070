-- Health of kuberl.io/RLExperiment, from status.phase and the metav1-style conditions the KubeRL
-- operator writes:
--   Healthy     Succeeded, or Running with condition Ready=True
--   Progressing Pending/Initializing, Running not yet Ready, or a spec change not yet reconciled
--   Degraded    Failed, condition Failed=True, condition Degraded=True, Validated=False, or
--               Reconciled=False (a child cannot take the spec, e.g. an immutable field; never heals)
--   Suspended   phase Suspended
-- Lua 5.1 for gopher-lua using only the base and table libraries (no string, math or os), so it also
-- runs from argocd-cm without resource.customizations.useOpenLibs.

local function condition(status, ctype)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

local function explain(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c ~= nil and c.reason ~= nil then
    return c.reason
  end
  return fallback
end

local function progress(status)
  local p = status.progress
  if p == nil then
    return ""
  end
  local text = ""
  if p.steps ~= nil then
    text = "step " .. p.steps
  elseif p.step ~= nil then
    text = "step " .. tostring(p.step)
  end
  if p.rewardText ~= nil then
    text = text .. ", reward " .. p.rewardText
  end
  if text ~= "" then
    return " (" .. text .. ")"
  end
  return ""
end

local hs = {}
local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the KubeRL operator to report status"
  return hs
end

local phase = status.phase
local failed = condition(status, "Failed")
local degraded = condition(status, "Degraded")
local validated = condition(status, "Validated")
local ready = condition(status, "Ready")

if phase == "Failed" or is_true(failed) then
  hs.status = "Degraded"
  hs.message = explain(failed, "Experiment failed") .. progress(status)
  return hs
end
if validated ~= nil and validated.status == "False" then
  hs.status = "Degraded"
  hs.message = explain(validated, "The spec cannot run")
  return hs
end
local reconciled = condition(status, "Reconciled")
if reconciled ~= nil and reconciled.status == "False" then
  hs.status = "Degraded"
  hs.message = explain(reconciled, "A child could not take the spec")
  return hs
end
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = "Training complete" .. progress(status)
  return hs
end
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = explain(condition(status, "Suspended"), "Suspended") .. progress(status)
  return hs
end
if is_true(degraded) then
  hs.status = "Degraded"
  hs.message = explain(degraded, "Degraded") .. progress(status)
  return hs
end
-- A spec change the operator has not reconciled yet: the conditions describe the old spec.
if obj.metadata ~= nil and obj.metadata.generation ~= nil and status.observedGeneration ~= nil
    and status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile generation " .. tostring(obj.metadata.generation)
  return hs
end
if phase == "Running" then
  if is_true(ready) then
    hs.status = "Healthy"
    hs.message = "Training" .. progress(status)
  else
    hs.status = "Progressing"
    hs.message = explain(ready, "Starting roles") .. progress(status)
  end
  return hs
end
if phase == "Pending" or phase == "Initializing" then
  hs.status = "Progressing"
  hs.message = explain(condition(status, "Progressing"), phase)
  return hs
end
hs.status = "Unknown"
hs.message = "Unknown phase " .. tostring(phase)
return hs
