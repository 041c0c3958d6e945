{{/*
The tiers' workloads (batch-runner.yaml, nearline-worker.yaml): one image, two roles. Each pod is a client
of the gateway's public HTTP API, sending every request with the credential of the tenant that submitted it
(kept in Redis with the job or the queued request), so it holds no API key of its own; it reads and writes
its state in the release's Redis, and serves only /metrics.
*/}}

{{/* The gateway's in-cluster base URL: HTTPS with the services' own TLS, HTTP in the mesh (the sidecars' mTLS). */}}
{{- define "aiworks.gatewayURL" -}}
{{- $scheme := ternary "https" "http" (eq (include "aiworks.ownTLS" .) "true") -}}
{{- printf "%s://%s:%v" $scheme (include "aiworks.componentName" (dict "root" . "component" "gateway")) (include "aiworks.ports" . | fromYaml).gateway.http -}}
{{- end }}

{{/* Batch files shared by the gateways and the runners: the volume's mount path. */}}
{{- define "aiworks.batchFilesDir" -}}/var/lib/aiworks/batch{{- end }}

{{/* The Batch API's store, as the gateways and the runners both need it: env entries. Call with $. */}}
{{- define "aiworks.batchFilesEnv" -}}
{{- $b := .Values.batchRunner }}
{{- with $b.files.credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom: {secretKeyRef: {name: {{ . }}, key: AWS_ACCESS_KEY_ID}}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom: {secretKeyRef: {name: {{ . }}, key: AWS_SECRET_ACCESS_KEY}}
{{- end }}
{{- with $b.files.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* One tier's Deployment, Service (metrics only) and account. Call with (dict "root" $ "component" "batch-runner"
"values" .Values.batchRunner "args" [role words] "redisEnv" "AIWORKS_BATCH_REDIS_URL" "env" "<yaml env entries>"
"metricsPort" 8050 "mounts" "<yaml>" "volumes" "<yaml>"). */}}
{{- define "aiworks.tierWorkload" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $c := dict "root" $root "component" .component "values" $v }}
{{- $name := include "aiworks.componentName" $c }}
{{- if ne (include "aiworks.hasRedis" $root) "true" }}
{{- fail (printf "%s needs a Redis (its jobs or queue live there): redis.enabled, or redis.external" .component) }}
{{- end }}
{{- include "aiworks.serviceAccount" $c }}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "aiworks.labels" $c | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "aiworks.selectorLabels" $c | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "aiworks.labels" $c | nindent 8 }}
        app: {{ .component }}
      annotations:
        {{- include "aiworks.podAnnotations" (merge (dict "metricsPort" .metricsPort) $c) | nindent 8 }}
    spec:
      {{- include "aiworks.podCommon" $c | nindent 6 }}
      # A job's lease (15 s) or a request's claim (30 s) passes to another pod when this one goes away.
      terminationGracePeriodSeconds: 30
      containers:
        - name: {{ .component }}
          image: {{ include "aiworks.image" (dict "root" $root "image" $v.image) }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          # The image's entrypoint is `aiworks`; these name the role.
          args:
            {{- toYaml .args | nindent 12 }}
          ports:
            - {name: metrics, containerPort: {{ .metricsPort }}, protocol: TCP}
          env:
            {{- include "aiworks.redisEnv" (dict "root" $root "name" .redisEnv) | nindent 12 }}
            {{- .env | nindent 12 }}
            {{- include "aiworks.tracingEnv" $c | nindent 12 }}
            {{- with $v.extraEnv }}{{ toYaml . | nindent 12 }}{{- end }}
          # It serves only /metrics (a thread of the process): up, not proof that its work moves.
          readinessProbe:
            httpGet: {path: /metrics, port: metrics}
            periodSeconds: 10
            timeoutSeconds: 5
          livenessProbe:
            httpGet: {path: /metrics, port: metrics}
            periodSeconds: 20
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          {{- include "aiworks.containerSecurity" $root | nindent 10 }}
          volumeMounts:
            - {name: tmp, mountPath: /tmp}
            {{- with .mounts }}{{ . | nindent 12 }}{{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- with .volumes }}{{ . | nindent 8 }}{{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "aiworks.labels" $c | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "aiworks.selectorLabels" $c | nindent 4 }}
  ports:
    - {name: http-metrics, port: {{ .metricsPort }}, targetPort: metrics, protocol: TCP, appProtocol: http}
{{- if $v.podDisruptionBudget.enabled }}
---
{{ include "aiworks.pdb" (merge (dict "name" $name "pdb" $v.podDisruptionBudget "selector" (include "aiworks.selectorLabels" $c | fromYaml)) $c) }}
{{- end }}
{{- end }}

{{/* The gateway's CA, for the tiers' HTTPS calls: only ca.crt of the gateway's Secret (never its key). */}}
{{- define "aiworks.gatewayCAVolume" -}}
{{- if eq (include "aiworks.ownTLS" .) "true" }}
- name: gateway-ca
  secret:
    secretName: {{ include "aiworks.tlsSecretName" (dict "root" . "identity" "gateway") }}
    defaultMode: 0444
    items:
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end }}
{{- define "aiworks.gatewayCAMount" -}}
{{- if eq (include "aiworks.ownTLS" .) "true" }}
- {name: gateway-ca, mountPath: /etc/aiworks/gateway-ca, readOnly: true}
{{- end }}
{{- end }}

{{/* The tiers' credential key (docs/tiers.md, "Credentials"): the gateway seals each caller's credential under it
while a batch job or an asynchronous request waits in Redis, and the tiers' pods open it. The install hook makes
PREFIX-credential-key unless credentialKey.existingSecret names one (key `credential-key`). */}}
{{- define "aiworks.tiersOn" -}}
{{- if or .Values.batchRunner.enabled .Values.nearlineWorker.enabled }}true{{ end -}}
{{- end }}
{{- define "aiworks.credentialKeySecret" -}}
{{- .Values.credentialKey.existingSecret | default (printf "%s-credential-key" (include "aiworks.fullname" .)) -}}
{{- end }}
{{- define "aiworks.credentialKeyFile" -}}/etc/aiworks/credential-key/credential-key{{- end }}
{{- define "aiworks.credentialKeyVolume" -}}
- name: credential-key
  secret:
    secretName: {{ include "aiworks.credentialKeySecret" . }}
    defaultMode: 0400
    items:
      - {key: credential-key, path: credential-key}
{{- end }}
{{- define "aiworks.credentialKeyMount" -}}
- {name: credential-key, mountPath: /etc/aiworks/credential-key, readOnly: true}
{{- end }}
