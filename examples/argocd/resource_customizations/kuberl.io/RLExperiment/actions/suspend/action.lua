-- Argo CD action "suspend": the operator checkpoints, then scales every role of the experiment to zero.
if obj.spec == nil then
  obj.spec = {}
end
obj.spec.suspend = true
return obj
