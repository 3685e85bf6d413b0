{{/* Chart name. */}}
{{- define "tollgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object name prefix: the release name, plus the chart name unless it already contains it. */}}
{{- define "tollgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tollgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "tollgate.labels" -}}
helm.sh/chart: {{ include "tollgate.chart" . }}
app.kubernetes.io/name: {{ include "tollgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tollgate
{{- end }}

{{- define "tollgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tollgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{- define "tollgate.controllerName" -}}
{{ include "tollgate.fullname" . }}-controller
{{- end }}

{{- define "tollgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tollgate.controllerName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tollgate.mutatingWebhookName" -}}
{{ include "tollgate.fullname" . }}-sidecar-injector
{{- end }}

{{- define "tollgate.validatingWebhookName" -}}
{{ include "tollgate.fullname" . }}-policy-validator
{{- end }}

{{/* Secret with the webhook serving certificate (self-signed mode writes it; cert-manager fills it). */}}
{{- define "tollgate.webhookSecretName" -}}
{{ include "tollgate.fullname" . }}-webhook-tls
{{- end }}

{{/* Secret with the installation's key-hash secret (the controller fills it once). */}}
{{- define "tollgate.keyHashSecretName" -}}
{{ include "tollgate.fullname" . }}-key-hash
{{- end }}

{{/* DNS names the API server uses to reach the webhook Service. */}}
{{- define "tollgate.webhookDNSNames" -}}
{{- $svc := include "tollgate.controllerName" . -}}
{{ $svc }}.{{ .Release.Namespace }}.svc,{{ $svc }}.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}
{{- end }}

{{/* An image reference: imageRegistry (if set) replaces the repository's registry and path up
to the image name; a digest wins over the tag. */}}
{{- define "tollgate.imageRef" -}}
{{- $repo := .image.repository -}}
{{- if .registry }}{{ $repo = printf "%s/%s" (trimSuffix "/" .registry) (last (splitList "/" $repo)) }}{{ end -}}
{{- if .image.digest }}{{ $repo }}@{{ .image.digest }}{{ else }}{{ $repo }}:{{ default .appVersion .image.tag }}{{ end -}}
{{- end }}

{{- define "tollgate.image" -}}
{{ include "tollgate.imageRef" (dict "image" .Values.image "registry" .Values.imageRegistry "appVersion" .Chart.AppVersion) }}
{{- end }}

{{- define "tollgate.sidecarImage" -}}
{{ include "tollgate.imageRef" (dict "image" .Values.sidecar.image "registry" .Values.imageRegistry "appVersion" .Chart.AppVersion) }}
{{- end }}

{{/* Values reused from a chart before tollgate-ratelimit had an image of its own
(`helm upgrade --reuse-values`) have no rateLimitService.image: default to the published one. */}}
{{- define "tollgate.rateLimitServiceImage" -}}
{{- $image := .Values.rateLimitService.image | default (dict "repository" "ghcr.io/tollgate-dev/tollgate-ratelimit") -}}
{{ include "tollgate.imageRef" (dict "image" $image "registry" .Values.imageRegistry "appVersion" .Chart.AppVersion) }}
{{- end }}

{{/* The Redis URL passed to sidecars ("" when global limits stay per sidecar). */}}
{{- define "tollgate.redisURL" -}}
{{- if .Values.redis.dev.enabled -}}
redis://{{ include "tollgate.fullname" . }}-redis.{{ .Release.Namespace }}.svc:6379
{{- else if .Values.redis.url -}}
{{- $urls := list -}}
{{- range (splitList "," .Values.redis.url) -}}
{{- $u := trim . -}}
{{- if $.Values.redis.tls.enabled -}}{{- $u = regexReplaceAll "^redis://" $u "rediss://" -}}{{- end -}}
{{- if and $.Values.redis.tls.insecureSkipVerify (hasPrefix "rediss://" $u) -}}{{- $u = printf "%s#insecure" $u -}}{{- end -}}
{{- $urls = append $urls $u -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}
{{- end }}

{{/* The rule stream URL sidecars (injected, and the rate limit service) connect to. */}}
{{- define "tollgate.controllerURL" -}}
{{- if .Values.streamTLS.enabled -}}
https://{{ include "tollgate.controllerName" . }}.{{ .Release.Namespace }}.svc:{{ .Values.service.streamTLSPort }}
{{- else -}}
http://{{ include "tollgate.controllerName" . }}.{{ .Release.Namespace }}.svc:{{ .Values.service.streamPort }}
{{- end -}}
{{- end }}

{{- define "tollgate.rateLimitServiceName" -}}
{{ include "tollgate.fullname" . }}-rate-limit-service
{{- end }}

{{/* Labels selecting the rate limit service's pods; RateLimitPolicies select them too. */}}
{{- define "tollgate.rateLimitServiceSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tollgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: rate-limit-service
{{- end }}

{{- define "tollgate.rateLimitServiceAccountName" -}}
{{- default (include "tollgate.rateLimitServiceName" .) .Values.rateLimitService.serviceAccount.name }}
{{- end }}

{{/* Pods the injection webhook must never touch: tollgate's own. */}}
{{- define "tollgate.objectSelectorExclusions" -}}
- key: tollgate.dev/control-plane
  operator: DoesNotExist
{{- end }}
