{{/* Names and labels. */}}
{{- define "delayd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "delayd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if eq .Values.shape "sidecar" -}}
{{- .Values.app.name | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "delayd.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "delayd.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "delayd.selectorLabels" -}}
app.kubernetes.io/name: {{ ternary .Values.app.name (include "delayd.name" .) (eq .Values.shape "sidecar") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The name of delayd's own objects (ConfigMap, Service, ...): beside the
application's in the sidecar shape, so "<app>-delayd" there. */}}
{{- define "delayd.objectName" -}}
{{- if eq .Values.shape "sidecar" -}}
{{- printf "%s-delayd" (include "delayd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- include "delayd.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "delayd.labels" -}}
{{ include "delayd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "delayd.secretName" -}}
{{- default (include "delayd.objectName" .) .Values.secret.existingSecret -}}
{{- end -}}

{{/* Memory from the measured RSS per pending message (see values.yaml). */}}
{{- define "delayd.memoryRequestMiB" -}}
{{- $r := .Values.resources -}}
{{- $bytes := mul (int64 $r.expectedPending) (int64 $r.bytesPerPending) -}}
{{- add (int64 $r.baseMiB) (div (add $bytes 1048575) 1048576) -}}
{{- end -}}

{{- define "delayd.resources" -}}
{{- if .Values.resources.override -}}
{{ toYaml .Values.resources.override }}
{{- else -}}
{{- $req := int64 (include "delayd.memoryRequestMiB" .) -}}
requests:
  cpu: {{ .Values.resources.cpuRequest }}
  memory: {{ printf "%dMi" $req }}
limits:
  memory: {{ printf "%dMi" (mul $req (int64 .Values.resources.limitFactor)) }}
  {{- with .Values.resources.cpuLimit }}
  cpu: {{ . }}
  {{- end }}
{{- end -}}
{{- end -}}

{{/*
The delayd container. `sidecar` adds restartPolicy: Always (a native
sidecar) and leaves the readiness probe out: Kubernetes counts a native
sidecar's readiness in the pod's, so /readyz there would take the
application's pods out of their Service whenever a broker is away.
*/}}
{{- define "delayd.container" -}}
{{- $sidecar := eq .Values.shape "sidecar" -}}
{{- $local := eq .Values.shape "statefulset" -}}
- name: delayd
  image: {{ printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if $sidecar }}
  restartPolicy: Always
  {{- end }}
  args: ["run", "--config", "/etc/delayd/delayd.toml"]
  env:
    - { name: DELAYD_STORE__KIND, value: {{ ternary "local" "broker" $local | quote }} }
    {{- if $local }}
    # On the claim, mounted before the container starts: creating wal/ in it is safe.
    - { name: DELAYD_WAL__DIR, value: /var/lib/delayd/wal }
    {{- else }}
    # A scratch directory: with the broker-kept store the WAL is a working copy.
    - { name: DELAYD_WAL__DIR, value: /var/lib/delayd/wal }
    {{- end }}
    - { name: DELAYD_WAL__CREATE_DIR, value: "true" }
    # Probes reach the pod IP, so listen beyond loopback; that needs the token.
    - { name: DELAYD_HTTP__LISTEN, value: {{ printf "0.0.0.0:%d" (int .Values.adminPort) | quote }} }
    - { name: DELAYD_LOG__FORMAT, value: {{ .Values.log.format | quote }} }
    - { name: DELAYD_LOG__LEVEL, value: {{ .Values.log.level | quote }} }
    {{- range $name, $key := .Values.secret.env }}
    - name: {{ $name }}
      valueFrom: { secretKeyRef: { name: {{ include "delayd.secretName" $ }}, key: {{ $key }} } }
    {{- end }}
    {{- with .Values.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - { name: admin, containerPort: {{ .Values.adminPort }}, protocol: TCP }
  # Answers once the WAL is recovered (the admin listener opens then); until
  # it does, liveness waits and, as a sidecar, so does the application.
  startupProbe:
    httpGet: { path: /healthz, port: admin }
    {{- toYaml .Values.probes.startup | nindent 4 }}
  # Fails only once the WAL or store has failed for good: restart it.
  livenessProbe:
    httpGet: { path: /healthz, port: admin }
    {{- toYaml .Values.probes.liveness | nindent 4 }}
  {{- if not $sidecar }}
  # 503 until every route consumes (or stands by), while a broker is away
  # and while a partition is restored: no admin traffic, and a rolling
  # update waits for it.
  readinessProbe:
    httpGet: { path: /readyz, port: admin }
    {{- toYaml .Values.probes.readiness | nindent 4 }}
  {{- end }}
  resources:
    {{- include "delayd.resources" . | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - { name: config, mountPath: /etc/delayd, readOnly: true }
    - { name: {{ ternary "wal" "scratch" $local }}, mountPath: /var/lib/delayd }
{{- end -}}

{{- define "delayd.podVolumes" -}}
- name: config
  configMap: { name: {{ include "delayd.objectName" . }} }
{{- if ne .Values.shape "statefulset" }}
- name: scratch
  emptyDir: { sizeLimit: {{ .Values.wal.scratchSizeLimit }} }
{{- end }}
{{- end -}}

{{- define "delayd.podSpecCommon" -}}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "delayd.podMetadata" -}}
metadata:
  labels:
    {{- include "delayd.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ .Values.config | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
