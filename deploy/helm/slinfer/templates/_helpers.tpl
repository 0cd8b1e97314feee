{{/* Names: <release>-slinfer, or the release name alone when it already says slinfer. */}}
{{- define "slinfer.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* dict "root" $ "component" "gateway" */}}
{{- define "slinfer.labels" -}}
{{ include "slinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* dict "root" $ "kind" <hardware kind values or empty dict> */}}
{{- define "slinfer.image" -}}
{{- $img := merge (dict) (.kind.image | default dict) .root.Values.image -}}
image: {{ printf "%s:%s" $img.repository (($img.tag | default .root.Chart.AppVersion) | toString) | quote }}
imagePullPolicy: {{ $img.pullPolicy }}
{{- end -}}

{{- define "slinfer.secretName" -}}
{{- .Values.auth.existingSecret | default (include "slinfer.fullname" .) -}}
{{- end -}}

{{/* The Redis URL, with $(REDIS_PASSWORD) where the password goes (Kubernetes expands it). */}}
{{- define "slinfer.redisUrl" -}}
{{- $r := .Values.redis -}}
{{- $cred := ternary ":$(REDIS_PASSWORD)@" "" (include "slinfer.redisHasPassword" . | eq "true") -}}
{{- if $r.sentinels -}}
{{- printf "redis+sentinel://%s%s/%s/%d" $cred (join "," $r.sentinels) $r.masterSet (int $r.db) -}}
{{- else if $r.url -}}
{{- regexReplaceAll "^(rediss?://)" $r.url (printf "${1}%s" $cred) -}}
{{- else -}}
{{- fail "redis: set redis.sentinels (Sentinel failover) or redis.url (one server)" -}}
{{- end -}}
{{- end -}}

{{- define "slinfer.redisHasPassword" -}}
{{- or .Values.redis.password .Values.redis.passwordSecret.name | toString | ne "" | ternary "true" "false" -}}
{{- end -}}

{{/*
The environment every slinfer container starts with: the ConfigMap, the Redis URL with its
password, and the service's name for traces and logs. dict "root" $ "service" "slinfer-gateway"
*/}}
{{- define "slinfer.env" -}}
{{- $v := .root.Values -}}
{{- if eq (include "slinfer.redisHasPassword" .root) "true" }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- if $v.redis.password }}
      name: {{ include "slinfer.fullname" .root }}
      key: redis-password
      {{- else }}
      name: {{ $v.redis.passwordSecret.name }}
      key: {{ $v.redis.passwordSecret.key }}
      {{- end }}
{{- end }}
- name: SLINFER_REDIS_URL
  value: {{ include "slinfer.redisUrl" .root | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .service }}
{{- range $name, $value := .extra }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* The pod template's checksum of the ConfigMap, so a settings change rolls the pods. */}}
{{- define "slinfer.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{- define "slinfer.metricsAnnotations" -}}
{{- if .Values.metrics.enabled }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* The models volume, shared by every pod that reads or converts a registered model. */}}
{{- define "slinfer.modelsVolume" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim | default (printf "%s-models" (include "slinfer.fullname" .)) }}
{{- end -}}

{{- define "slinfer.podSecurity" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* nodeSelector and tolerations: dict "nodeSelector" ... "tolerations" ... */}}
{{- define "slinfer.placement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A container's resources; a GPU kind's also claim its GPUs. dict "resources" ... "kind" "gpu" "hw" ... */}}
{{- define "slinfer.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if eq .kind "gpu" -}}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (.hw.gpusPerPod | int)) ($res.limits | default dict)) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
