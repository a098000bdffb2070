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
# Accelerator capacity (nvidia.com/gpu, huawei.com/Ascend910), reported, never blocking.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list"]
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
{{- end -}}

{{/* Namespaced rules: in the ClusterRole (cluster-wide) or in a Role per watched namespace. */}}
{{- define "kuberl.namespacedRules" -}}
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
# Children, by server-side apply (create + patch) and read back (get). Secrets: the bus credentials
# the operator makes, and the ones the spec names; never listed or watched.
- apiGroups: [""]
  resources: ["configmaps", "secrets", "services", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# Workloads: also listed and watched (caches of the children's state); the trainer Job is deleted
# and re-created when its immutable template must change or after a failure.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Pods: read-only (readiness and problems for status).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Kueue (kuberl.operator.kueue): the Workload of an experiment labelled kueue.x-k8s.io/queue-name,
# and its quota given back after an eviction; list/watch for the operator's Workload cache. Harmless where Kueue is not installed.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
# Events on experiments (kopf posts them through both APIs).
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
