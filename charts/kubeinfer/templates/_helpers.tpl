{{/* Names: object names are "<fullname>-<component>", at most 63 characters. */}}
{{- define "kubeinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kubeinfer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "kubeinfer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kubeinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubeinfer
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "component" "operator"). */}}
{{- define "kubeinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubeinfer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kubeinfer.componentLabels" -}}
{{ include "kubeinfer.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* "registry/repository:tag" or "registry/repository@digest". The registry (imageRegistry) prefixes a
repository that is a bare name (no "/"); a repository with a "/" is a full image name and is used as it
is. The tag: the image's own, else imageTag, else the chart's appVersion. */}}
{{- define "kubeinfer.image" -}}
{{- $registry := trimSuffix "/" (.root.Values.imageRegistry | default "") }}
{{- $repository := .image.repository }}
{{- if and $registry (not (contains "/" $repository)) }}
{{- $repository = printf "%s/%s" $registry $repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repository .image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (.image.tag | default .root.Values.imageTag | default .root.Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* Pod and container security: non-root, no privilege escalation, no capabilities, read-only root. */}}
{{- define "kubeinfer.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "kubeinfer.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Scheduling and pull settings shared by the operator and gateway pods: call with the component's values. */}}
{{- define "kubeinfer.podPlacement" -}}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The namespace whose engine pods the gateway routes to. */}}
{{- define "kubeinfer.gatewayNamespace" -}}
{{- default .Release.Namespace .Values.gateway.watchNamespace }}
{{- end }}

{{/* "k=v,k=v" for --selector, keys sorted so the rendered Deployment is stable. */}}
{{- define "kubeinfer.gatewaySelector" -}}
{{- $pairs := list }}
{{- range $key, $value := .Values.gateway.selector }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* Cluster-scoped objects carry the release namespace too: two releases of the same name never collide. */}}
{{- define "kubeinfer.clusterName" -}}
{{- printf "%s-%s-%s" .root.Release.Namespace (include "kubeinfer.fullname" .root) .suffix }}
{{- end }}

{{/*
What the operator does in a namespace it reconciles, and nothing more. Verbs follow the handlers:
kopf patches InferenceModels (finalizers, progress annotations) and their status; the builders'
objects are created, patched and deleted; pods are only relabelled (active/standby) and annotated
(adapter placement).
*/}}
{{- define "kubeinfer.operatorNamespacedRules" -}}
# Exactly the calls the operator makes: it applies owned objects with server-side apply (PATCH, or
# POST when absent), watches them to repair drift, and leaves their deletion to owner references
# and the garbage collector.
- apiGroups: [serving.kubeinfer.io]
  resources: [inferencemodels]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kubeinfer.io]
  resources: [inferencemodels/status]
  verbs: [patch]
# The built-in autoscaler writes replicas where kubectl scale, an HPA or KEDA do.
- apiGroups: [serving.kubeinfer.io]
  resources: [inferencemodels/scale]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need it where OwnerReferencesPermissionEnforcement is on (OpenShift).
- apiGroups: [serving.kubeinfer.io]
  resources: [inferencemodels/finalizers]
  verbs: [update]
# delete: a model whose spec.engine.parallelism.nodes moves between 1 and more swaps its Deployment for a
# LeaderWorkerSet (or back), and the old one goes once the new one serves.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, watch, create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# The NetworkPolicy of each model; delete only for --no-network-policy, which removes the ones it built, and for
# the per-group policies of a multi-node model's groups scaled away.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# A multi-node model's group secret (KUBEINFER_TP_SECRET): created once, never read back or rewritten (no get).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- end }}

{{/* The gateway only reads: the engine pods it routes to and the InferencePools that select them. */}}
{{- define "kubeinfer.gatewayRules" -}}
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch]
# InferenceModels' spec.routing.priority makes a model's requests sheddable; so does the priority of the
# Inference Extension's InferenceObjective a request names.
- apiGroups: [serving.kubeinfer.io]
  resources: [inferencemodels]
  verbs: [get, list, watch]
# A request for a model scaled to zero is held while the gateway asks for one replica (0 -> minReplicas).
- apiGroups: [serving.kubeinfer.io]
  resources: [inferencemodels/scale]
  verbs: [get, patch]
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives]
  verbs: [get, list, watch]
{{- end }}

{{/* The Secret holding the engines' API key (issue 34): the chart's own, or engineApiKey.existingSecret. */}}
{{- define "kubeinfer.engineApiKeySecret" -}}
{{- default (printf "%s-engine-api-key" (include "kubeinfer.fullname" .)) .Values.engineApiKey.existingSecret }}
{{- end }}

{{/* Namespaces where engine pods run, as a JSON list: the release's, the operator's and the gateway's. */}}
{{- define "kubeinfer.engineNamespaces" -}}
{{- $namespaces := list .Release.Namespace }}
{{- range .Values.operator.watchNamespaces }}
{{- $namespaces = append $namespaces . }}
{{- end }}
{{- if .Values.gateway.watchNamespace }}
{{- $namespaces = append $namespaces .Values.gateway.watchNamespace }}
{{- end }}
{{- $namespaces | uniq | toJson }}
{{- end }}

{{/* The engines' key as an env var (KUBEINFER_ENGINE_API_KEY) for the gateway and the operator. */}}
{{- define "kubeinfer.engineApiKeyEnv" -}}
{{- if .Values.engineApiKey.enabled }}
# The key engines require on /v1 (issue 34): presented on every request to an engine.
- name: KUBEINFER_ENGINE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kubeinfer.engineApiKeySecret" . }}
      key: {{ .Values.engineApiKey.key }}
{{- end }}
{{- end }}

{{/* NetworkPolicyPeers (JSON) allowed to the engine API ports: this release's gateway and operator pods. */}}
{{- define "kubeinfer.engineApiPeers" -}}
{{- $peers := list }}
{{- range $component := list "gateway" "operator" }}
{{- $labels := include "kubeinfer.selectorLabels" (dict "root" $ "component" $component) | fromYaml }}
{{- $peers = append $peers (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" $.Release.Namespace)) "podSelector" (dict "matchLabels" $labels)) }}
{{- end }}
{{- concat $peers .Values.networkPolicy.extraApiPeers | toJson }}
{{- end }}

{{/* NetworkPolicyPeers (JSON) allowed to the engines' KV-event ports: this release's gateway pods alone (not the
API peers: the events carry prompts' token ids), plus extraKvEventsPeers. */}}
{{- define "kubeinfer.kvEventsPeers" -}}
{{- $labels := include "kubeinfer.selectorLabels" (dict "root" . "component" "gateway") | fromYaml }}
{{- $peers := list (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" $labels)) }}
{{- concat $peers .Values.networkPolicy.extraKvEventsPeers | toJson }}
{{- end }}
