"""KWOK's stages for the local control plane (kuberl.testing.control_plane): how its fake nodes and pods move.

Nodes get their conditions, addresses and the allocatable the test set; a scheduled pod goes Running and Ready (kwok's
"fast" stages); annotations play what its containers would do: `kwok.kuberl.io/exit-code` (exit with that code: a pod
that restarts waits in CrashLoopBackOff, one that does not ends Succeeded or Failed), `kwok.kuberl.io/waiting-reason`
(a new pod stays Pending, its containers waiting for that reason) and `kwok.kuberl.io/message`; a deleted pod goes at
once, unless it has `kwok.kuberl.io/hold-termination` (it stays terminating, as behind a long grace period or on a
node that stopped answering, until the annotation is removed). Templates are Go text/template over the object,
selectors jq expressions (sigs.k8s.io/kwok's Stage API).
"""

STAGES = r"""
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: node-initialize}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: NotIn, values: ['True']}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $now | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
      addresses:
      - {address: {{ NodeIP | Quote }}, type: InternalIP}
      - {address: {{ NodeName | Quote }}, type: Hostname}
      allocatable:
      {{ YAML .status.allocatable 1 }}
      capacity:
      {{ YAML .status.allocatable 1 }}
      nodeInfo:
        architecture: amd64
        kubeletVersion: fake
        operatingSystem: linux
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: pod-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: NotIn, values: ['True']}
    - {key: '.metadata.annotations["kwok.kuberl.io/waiting-reason"]', operator: DoesNotExist}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Initialized}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Ready}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: ContainersReady}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: PodScheduled}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
      {{ end }}
      {{ with NodeIPsWith .spec.nodeName }}
      hostIP: {{ index . 0 | Quote }}
      {{ end }}
      {{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
      podIP: {{ index . 0 | Quote }}
      podIPs:
      {{ range . }}
      - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: pod-waiting}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
    - {key: .spec.nodeName, operator: Exists}
    - {key: .status.containerStatuses, operator: DoesNotExist}
    - {key: '.metadata.annotations["kwok.kuberl.io/waiting-reason"]', operator: Exists}
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $reason := index .metadata.annotations "kwok.kuberl.io/waiting-reason" }}
      {{ $message := or (index .metadata.annotations "kwok.kuberl.io/message") "" }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "False", type: Ready, reason: ContainersNotReady}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: PodScheduled}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        started: false
        restartCount: 0
        state: {waiting: {reason: {{ $reason | Quote }}, message: {{ $message | Quote }}}}
      {{ end }}
      phase: Pending
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: pod-exit}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Running]}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: In, values: ['True']}
    - {key: '.metadata.annotations["kwok.kuberl.io/exit-code"]', operator: Exists}
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $code := index .metadata.annotations "kwok.kuberl.io/exit-code" }}
      {{ $message := or (index .metadata.annotations "kwok.kuberl.io/message") "" }}
      {{ $restarts := eq (or .spec.restartPolicy "Always") "Always" }}
      {{ $why := "PodCompleted" }}{{ if $restarts }}{{ $why = "ContainersNotReady" }}{{ end }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "False", type: Ready, reason: {{ $why }}}
      - {lastTransitionTime: {{ $now | Quote }}, status: "False", type: ContainersReady, reason: {{ $why }}}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        started: false
        {{ if $restarts }}
        restartCount: 4
        state: {waiting: {reason: CrashLoopBackOff, message: "back-off 1m20s restarting failed container"}}
        lastState:
        {{ else }}
        restartCount: 0
        state:
        {{ end }}
          terminated:
            exitCode: {{ $code }}
            reason: {{ if eq $code "0" }}Completed{{ else }}Error{{ end }}
            message: {{ $message | Quote }}
            startedAt: {{ $now | Quote }}
            finishedAt: {{ $now | Quote }}
      {{ end }}
      phase: {{ if $restarts }}Running{{ else if eq $code "0" }}Succeeded{{ else }}Failed{{ end }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: pod-delete}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: Exists}
    - {key: '.metadata.annotations["kwok.kuberl.io/hold-termination"]', operator: DoesNotExist}
  next:
    finalizers: {empty: true}
    delete: true
"""
