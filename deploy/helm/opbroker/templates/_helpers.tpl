{{/* The chart's name, or nameOverride. */}}
{{- define "opbroker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name, used for the objects' names; truncated to leave room for the
longest suffix (-principals) within 63 characters.
*/}}
{{- define "opbroker.fullname" -}}
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

{{- define "opbroker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "opbroker.labels" -}}
helm.sh/chart: {{ include "opbroker.chart" . }}
app.kubernetes.io/name: {{ include "opbroker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* What selects the broker's pods (and not the migration Job's). */}}
{{- define "opbroker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "opbroker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: broker
{{- end }}

{{- define "opbroker.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The names of the objects the pods read, whether the chart creates them or not. */}}
{{- define "opbroker.databaseSecret" -}}
{{- default (printf "%s-database" (include "opbroker.fullname" .)) .Values.database.secretName }}
{{- end }}

{{- define "opbroker.targetsConfigMap" -}}
{{- default (printf "%s-targets" (include "opbroker.fullname" .)) .Values.targets.existingConfigMap }}
{{- end }}

{{- define "opbroker.principalsSecret" -}}
{{- default (printf "%s-principals" (include "opbroker.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{- define "opbroker.tlsSecret" -}}
{{- default (printf "%s-tls" (include "opbroker.fullname" .)) .Values.tls.secretName }}
{{- end }}

{{/* The pod settings the broker's pods and the migration Job's share. */}}
{{- define "opbroker.podCommon" -}}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
