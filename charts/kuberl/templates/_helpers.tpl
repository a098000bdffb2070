{{/* Names and labels of the KubeRL operator chart, defined once. */}}

{{- define "kuberl.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name when it already contains the chart name. */}}
{{- define "kuberl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuberl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kuberl.labels" -}}
{{ include "kuberl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kuberl
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kuberl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kuberl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kuberl.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Cluster-scoped rules: always in the ClusterRole. */}}
{{- define "kuberl.clusterRules" -}}
# Accelerator capacity (nvidia.com/gpu, huawei.com/Ascend910), reported, never blocking: a watch of the Nodes.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
# Why a checkpoint or bus volume stays Pending (a missing StorageClass, no default one), read only then.
- apiGroups: ["storage.k8s.io"]
  resources: ["storageclasses"]
  verbs: ["list"]
# kopf: namespace discovery (cluster-wide mode) and the CRD's presence.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
# Kueue: the admitted flavours' nodeLabels and tolerations, put on the pods (kuberl.operator.kueue_status.placement),
# and the value of the WorkloadPriorityClass an experiment names (its Workload's spec.priority).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
{{- end -}}

{{/* Namespaced rules of a watched namespace (watchNamespaces: one Role each): what the operator reads
everywhere it watches, and what it writes there. */}}
{{- define "kuberl.namespacedRules" -}}
{{ include "kuberl.watchRules" . }}
{{ include "kuberl.writeRules" . }}
{{- end -}}

{{/* What the operator reads in every namespace it watches, and its own objects (the RLExperiment, its
status and events), which it must reach even where it may write nothing else: cluster-wide, these are
in the ClusterRole; no Secret, ConfigMap or pod-making write among them. */}}
{{- define "kuberl.watchRules" -}}
# The custom resource: watch it, add finalizers and the pin annotations, write the resolved
# replicas, serve /scale; delete it when spec.ttlSecondsAfterFinished has passed.
- apiGroups: ["kuberl.io"]
  resources: ["rlexperiments"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["kuberl.io"]
  resources: ["rlexperiments/status", "rlexperiments/scale"]
  verbs: ["get", "patch"]
# ownerReferences with blockOwnerDeletion need update on the owner's finalizers (OpenShift and
# clusters with the OwnerReferencesPermissionEnforcement admission plugin).
- apiGroups: ["kuberl.io"]
  resources: ["rlexperiments/finalizers"]
  verbs: ["update"]
# Workloads: listed and watched (caches of the children's state), never created here.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch"]
# Pods: read-only (readiness and problems for status).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Kueue (kuberl.operator.kueue): the Workload of an experiment labelled kueue.x-k8s.io/queue-name,
# and its quota given back after an eviction; list/watch for the operator's Workload cache. A Workload
# runs nothing (it only holds quota). Harmless where Kueue is not installed.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
# Events on experiments (kopf posts them through both APIs), also where the operator may not write
# (the NamespaceNotPermitted event says so).
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* What the operator writes in a namespace that runs experiments: the children, by server-side apply
(create + patch) and read back (get). Granted per namespace (templates/clusterrole.yaml): a Role in
each watched namespace, or, cluster-wide, the ClusterRole "<fullname>-namespaced" bound by a RoleBinding
in each tenant namespace. kuberl.operator.access checks these before it applies anything. */}}
{{- define "kuberl.writeRules" -}}
# Secrets: the bus and engine credentials the operator makes, and the ones the spec names; never
# listed or watched.
- apiGroups: [""]
  resources: ["configmaps", "secrets", "services", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# The tool sandbox's Deployment (workflow.sandbox.placement pod); its pods get no token and no Secret.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
# The trainer Job is deleted and re-created when its immutable template must change or after a failure.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "patch", "delete"]
{{- end -}}
