{{/*
Names, labels and the pieces every service template shares. Service-specific
settings stay in each service's own template and values block.
*/}}

{{- define "aiworks.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "aiworks.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "aiworks.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fixed ports of the suite's contract; every template reads them here. */}}
{{- define "aiworks.ports" -}}
gateway: {http: 8000, grpc: 8001, metrics: 8002}
scheduler: {grpc: 8010, metrics: 8011}
runtime: {grpc: 8020, metrics: 8021}
cache: {grpc: 8030, metrics: 8031}
monitor: {http: 8040, metrics: 8040}
batch-runner: {metrics: 8050}
nearline-worker: {metrics: 8051}
{{- end }}

{{/* Object name of one service: <fullname>-<component>. */}}
{{- define "aiworks.componentName" -}}
{{- printf "%s-%s" (include "aiworks.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of a runtime pool's Service: <fullname>-runtime-<model>. */}}
{{- define "aiworks.poolName" -}}
{{- printf "%s-runtime-%s" (include "aiworks.fullname" .root) .model }}
{{- end }}

{{/* In-cluster DNS name of a Service in the release namespace. */}}
{{- define "aiworks.host" -}}
{{- printf "%s.%s.svc.%s" .name .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* Selector labels: stable for the life of a release. Call with (dict "root" $ "component" "gateway"). */}}
{{- define "aiworks.selectorLabels" -}}
app.kubernetes.io/name: {{ include "aiworks.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "aiworks.labels" -}}
helm.sh/chart: {{ include "aiworks.chart" .root }}
{{ include "aiworks.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: aiworks
{{- end }}

{{/* Labels without a component, for release-wide objects. */}}
{{- define "aiworks.releaseLabels" -}}
helm.sh/chart: {{ include "aiworks.chart" . }}
app.kubernetes.io/name: {{ include "aiworks.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: aiworks
{{- end }}

{{/* Image reference. Call with (dict "root" $ "image" .Values.gateway.image "tag" "optional override"). */}}
{{- define "aiworks.image" -}}
{{- $tag := .tag | default .image.tag | default .root.Chart.AppVersion }}
{{- if .root.Values.imageRegistry }}
{{- printf "%s/%s:%s" .root.Values.imageRegistry .image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{- define "aiworks.serviceAccountName" -}}
{{- include "aiworks.componentName" . }}
{{- end }}

{{/* SPIFFE principal of a service's account, as Istio AuthorizationPolicies name it. */}}
{{- define "aiworks.principal" -}}
{{- printf "%s/ns/%s/sa/%s" .root.Values.istio.trustDomain .root.Release.Namespace (include "aiworks.serviceAccountName" .) }}
{{- end }}

{{/* ServiceAccount of one service. Call with (dict "root" $ "component" "gateway" "values" .Values.gateway). */}}
{{- define "aiworks.serviceAccount" -}}
{{- if .values.serviceAccount.create }}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "aiworks.serviceAccountName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "aiworks.labels" . | nindent 4 }}
  {{- with .values.serviceAccount.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: {{ .values.serviceAccount.automountToken }}
{{- end }}
{{- end }}

{{/* Pod annotations: config checksum, Prometheus scrape hints (used by Istio's metrics merging), user annotations. */}}
{{- define "aiworks.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .metricsPort | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- /* In the mesh, the sidecar stays for the container's own stop (its drain, stopSeconds) instead of Istio's
default 5 s, and leaves once no connection is open. */}}
{{- if and .root.Values.istio.enabled .stopSeconds (not (hasKey (.values.podAnnotations | default dict) "proxy.istio.io/config")) }}
proxy.istio.io/config: {{ dict "terminationDrainDuration" (printf "%ds" (int .stopSeconds)) "proxyMetadata" (dict "EXIT_ON_ZERO_ACTIVE_CONNECTIONS" "true") | toJson | quote }}
{{- end }}
{{- with .values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every Deployment. Call with (dict "root" $ "component" "gateway" "values" .Values.gateway). */}}
{{- define "aiworks.podCommon" -}}
serviceAccountName: {{ include "aiworks.serviceAccountName" . }}
# Service links would add <SVC>_PORT=tcp://... variables, and AIWORKS_<SVC>_PORT is a setting.
enableServiceLinks: false
automountServiceAccountToken: {{ .values.serviceAccount.automountToken }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container hardening shared by every container. */}}
{{- define "aiworks.containerSecurity" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end }}

{{/* HorizontalPodAutoscaler on CPU, plus custom metrics when given. Call with
(dict "root" $ "component" "gateway" "name" "<deployment>" "autoscaling" {...} "external" [metrics] "labels" {extra labels}). */}}
{{- define "aiworks.hpa" -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "aiworks.labels" . | nindent 4 }}
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ .autoscaling.minReplicas }}
  maxReplicas: {{ .autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .autoscaling.targetCPUUtilizationPercentage }}
    {{- with .external }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .autoscaling.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* PodDisruptionBudget. Call with (dict "root" $ "component" "gateway" "name" "..." "pdb" {...} "selector" {labels}). */}}
{{- define "aiworks.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "aiworks.labels" . | nindent 4 }}
spec:
  {{- if hasKey .pdb "minAvailable" }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- toYaml .selector | nindent 6 }}
{{- end }}

{{/* How services authenticate their callers: "mesh" (Istio STRICT mTLS), "hook" or "cert-manager" (their own mTLS), or "insecure". */}}
{{- define "aiworks.callerAuth" -}}
{{- if .Values.istio.enabled -}}
mesh
{{- else if not .Values.internalTLS.enabled -}}
insecure
{{- else if eq .Values.internalTLS.provider "auto" -}}
{{- ternary "cert-manager" "hook" (.Capabilities.APIVersions.Has "cert-manager.io/v1/Certificate") -}}
{{- else -}}
{{- .Values.internalTLS.provider -}}
{{- end -}}
{{- end }}

{{/* True ("true") when the services hold certificates of their own. */}}
{{- define "aiworks.ownTLS" -}}
{{- has (include "aiworks.callerAuth" .) (list "hook" "cert-manager") -}}
{{- end }}

{{/* Secret with one identity's tls.crt, tls.key and ca.crt. Call with (dict "root" $ "identity" "gateway"). */}}
{{- define "aiworks.tlsSecretName" -}}
{{- printf "%s-%s-tls" (include "aiworks.fullname" .root) .identity }}
{{- end }}

{{/* Where each container finds its certificate. */}}
{{- define "aiworks.tlsDir" -}}/etc/aiworks/tls{{- end }}

{{/* Caller authentication settings of one service. Call with (dict "root" $ "prefix" "AIWORKS_GATEWAY_"). */}}
{{- define "aiworks.securityEnv" -}}
{{- $mode := include "aiworks.callerAuth" .root }}
{{- if eq $mode "mesh" }}
- {name: {{ .prefix }}MESH_MTLS, value: "true"}
{{- else if eq $mode "insecure" }}
- {name: {{ .prefix }}INSECURE, value: "true"}
{{- else }}
- {name: {{ .prefix }}TLS_CERT, value: {{ include "aiworks.tlsDir" . }}/tls.crt}
- {name: {{ .prefix }}TLS_KEY, value: {{ include "aiworks.tlsDir" . }}/tls.key}
- {name: {{ .prefix }}TLS_CA, value: {{ include "aiworks.tlsDir" . }}/ca.crt}
{{- end }}
{{- end }}

{{/* The certificate volume and mount, when services hold their own. Call with (dict "root" $ "identity" "gateway"). */}}
{{- define "aiworks.tlsVolume" -}}
{{- if eq (include "aiworks.ownTLS" .root) "true" }}
- name: tls
  secret:
    secretName: {{ include "aiworks.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- define "aiworks.tlsMount" -}}
{{- if eq (include "aiworks.ownTLS" .root) "true" }}
- {name: tls, mountPath: {{ include "aiworks.tlsDir" . }}, readOnly: true}
{{- end }}
{{- end }}

{{/*
Readiness, liveness and startup probes of a gRPC service. The kubelet's grpc
probe is plaintext only, so with the services' own mutual TLS readiness runs
`aiworks probe <service>` (it reads the pod's settings and certificate), and
liveness only checks the port accepts connections. Call with (dict "root" $
"identity" "scheduler" "port" 8010 "startupFailures" 30 "liveService" "").
*/}}
{{- define "aiworks.grpcProbes" -}}
{{- if eq (include "aiworks.ownTLS" .root) "true" }}
readinessProbe:
  exec:
    command: [aiworks, probe, --quiet, {{ .identity }}]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  tcpSocket: {port: {{ .port }}}
  periodSeconds: 10
  failureThreshold: 3
startupProbe:
  tcpSocket: {port: {{ .port }}}
  periodSeconds: 2
  failureThreshold: {{ .startupFailures }}
{{- else }}
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  grpc: {port: {{ .port }}{{ with .liveService }}, service: {{ . }}{{ end }}}
  periodSeconds: 10
  failureThreshold: 3
startupProbe:
  grpc: {port: {{ .port }}{{ with .liveService }}, service: {{ . }}{{ end }}}
  periodSeconds: 2
  failureThreshold: {{ .startupFailures }}
{{- end }}
{{- end }}

{{/* OpenTelemetry's standard variables. Call with (dict "root" $ "component" "gateway"). */}}
{{- define "aiworks.tracingEnv" -}}
{{- $t := .root.Values.tracing }}
{{- $attrs := list (printf "service.namespace=%s" .root.Release.Name) (printf "k8s.namespace.name=%s" .root.Release.Namespace) }}
{{- with $t.resourceAttributes }}{{ $attrs = append $attrs . }}{{ end }}
- {name: OTEL_SERVICE_NAME, value: aiworks-{{ .component }}}
- {name: OTEL_RESOURCE_ATTRIBUTES, value: {{ join "," $attrs | quote }}}
{{- if $t.otlpEndpoint }}
- {name: OTEL_EXPORTER_OTLP_ENDPOINT, value: {{ $t.otlpEndpoint | quote }}}
- {name: OTEL_TRACES_SAMPLER, value: {{ $t.sampler | quote }}}
- {name: OTEL_TRACES_SAMPLER_ARG, value: {{ $t.samplerArg | quote }}}
{{- end }}
{{- end }}

{{/* The Secret and key holding the Redis URL every Redis user reads; "" when there is no Redis. */}}
{{- define "aiworks.redisSecret" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s-redis" (include "aiworks.fullname" .) -}}
{{- else if .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end }}

{{/* The env entry giving a service the Redis URL, under its own name. Call with (dict "root" $ "name" "AIWORKS_GATEWAY_REDIS_URL"). */}}
{{- define "aiworks.redisEnv" -}}
{{- $secret := include "aiworks.redisSecret" .root }}
{{- if $secret }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ ternary "redis-url" .root.Values.redis.external.key .root.Values.redis.enabled }}
{{- else if .root.Values.redis.external.url }}
- {name: {{ .name }}, value: {{ .root.Values.redis.external.url | quote }}}
{{- end }}
{{- end }}

{{/* Whether the release has a Redis at all ("true"/"false"). */}}
{{- define "aiworks.hasRedis" -}}
{{- /* `or` returns its first true argument (a Secret's name), not a boolean. */ -}}
{{- if or .Values.redis.enabled .Values.redis.external.existingSecret .Values.redis.external.url }}true{{ else }}false{{ end -}}
{{- end }}

{{/* The tenants written to tenants.yaml: config.tenants, or one tenant with no limits when that list is empty. */}}
{{- define "aiworks.tenants" -}}
{{- $tenants := .Values.config.tenants }}
{{- if not $tenants }}
{{- $tenants = list (dict "name" .Values.auth.keys.generatedKeyTenant "models" (list "*")) }}
{{- end }}
{{- toYaml $tenants }}
{{- end }}

{{/* The admin identity: `helm test`, admin Jobs and CLIs (its ServiceAccount and certificate). */}}
{{- define "aiworks.adminName" -}}
{{- printf "%s-admin" (include "aiworks.fullname" .) }}
{{- end }}

{{/* Every scheduler, as runtimes and gateways dial them: the Service with one replica; with more, each pod of
the scheduler StatefulSet by its DNS name (runtimes register with all of them, gateways fail over between them). */}}
{{- define "aiworks.schedulerAddresses" -}}
{{- $name := include "aiworks.componentName" (dict "root" . "component" "scheduler") -}}
{{- $port := (include "aiworks.ports" . | fromYaml).scheduler.grpc -}}
{{- if gt (int .Values.scheduler.replicas) 1 -}}
{{- $pods := list -}}
{{- range $i := until (int .Values.scheduler.replicas) -}}
{{- $pods = append $pods (printf "%s-%d.%s-headless.%s.svc:%v" $name $i $name $.Release.Namespace $port) -}}
{{- end -}}
{{- join "," $pods -}}
{{- else -}}
{{- printf "%s:%v" $name $port -}}
{{- end -}}
{{- end }}

{{/* The scheduler's seed weights (AIWORKS_SCHEDULER_TRAFFIC_SEED): per pool with an enabled canary whose stable
and canary versions are set, {stable version: 100 - weight, canary version: weight}. */}}
{{- define "aiworks.trafficSeed" -}}
{{- $seed := dict -}}
{{- range $model, $pool := .Values.runtime.pools -}}
{{- if and $pool.canary.enabled $pool.canary.version $pool.stable.version -}}
{{- if eq (toString $pool.canary.version) (toString $pool.stable.version) -}}
{{- fail (printf "runtime.pools.%s: stable and canary serve the same version %v; a canary weight needs two versions" $model $pool.canary.version) -}}
{{- end -}}
{{- $_ := set $seed $model (dict (toString $pool.stable.version) (sub 100 (int $pool.canary.weight)) (toString $pool.canary.version) (int $pool.canary.weight)) -}}
{{- end -}}
{{- end -}}
{{- toJson $seed -}}
{{- end }}
