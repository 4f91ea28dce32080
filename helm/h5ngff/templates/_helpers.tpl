{{/* Names, labels and the lists the templates share. */}}

{{- define "h5ngff.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "h5ngff.fullname" -}}
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

{{- define "h5ngff.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "h5ngff.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: h5ngff
{{- end }}

{{- define "h5ngff.selectorLabels" -}}
app.kubernetes.io/name: {{ include "h5ngff.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "h5ngff.operatorSelectorLabels" -}}
{{ include "h5ngff.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "h5ngff.operatorServiceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "h5ngff.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image every h5ngff pod runs: a digest wins over a tag; the tag defaults to appVersion. */}}
{{- define "h5ngff.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "h5ngff.jobImage" -}}
{{- default (include "h5ngff.image" .) .Values.jobDefaults.image }}
{{- end }}

{{/* Served namespaces as a JSON list: [] cluster-wide, else watch.namespaces or the release's. */}}
{{- define "h5ngff.servedNamespaces" -}}
{{- if .Values.watch.clusterWide }}
{{- list | toJson }}
{{- else }}
{{- default (list .Release.Namespace) .Values.watch.namespaces | uniq | toJson }}
{{- end }}
{{- end }}

{{/* Namespaces that get the runner's ServiceAccount, Role and RoleBinding, as a JSON list. */}}
{{- define "h5ngff.runnerNamespaces" -}}
{{- if .Values.runner.namespaces }}
{{- .Values.runner.namespaces | uniq | toJson }}
{{- else if .Values.watch.clusterWide }}
{{- list .Release.Namespace | toJson }}
{{- else }}
{{- include "h5ngff.servedNamespaces" . }}
{{- end }}
{{- end }}

{{/*
Operator RBAC rules from files/rbac.yaml (generated from src/h5ngff/operator/schema/rbac.py), filtered:
  dict "ctx" $ "mode" ("clusterWide"|"namespaced") "clusterScoped" (true|false|"any")
*/}}
{{- define "h5ngff.operatorRules" -}}
{{- $ctx := .ctx }}
{{- $rules := ($ctx.Files.Get "files/rbac.yaml" | fromYaml).operator }}
{{- range $rules }}
{{- $scoped := or (eq (toString $.clusterScoped) "any") (eq .clusterScoped $.clusterScoped) }}
{{- $peering := or (not .peering) $ctx.Values.operator.peering.enabled }}
{{- if and $scoped $peering (has $.mode .modes) }}
- apiGroups: {{ toJson .apiGroups }}
  resources: {{ toJson .resources }}
  verbs: {{ toJson .verbs }}
{{- end }}
{{- end }}
{{- end }}

{{- define "h5ngff.runnerRules" -}}
{{- range (.Files.Get "files/rbac.yaml" | fromYaml).runner }}
- apiGroups: {{ toJson .apiGroups }}
  resources: {{ toJson .resources }}
  verbs: {{ toJson .verbs }}
{{- end }}
{{- end }}
