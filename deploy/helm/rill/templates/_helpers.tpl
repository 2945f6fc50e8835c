{{/* The pods' selector: the same for the Deployment, Service, PDB, ServiceMonitor and InferencePool. */}}
{{- define "rill.selectorLabels" -}}
app.kubernetes.io/name: rill
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "rill.labels" -}}
{{ include "rill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The endpoint picker's name and selector. */}}
{{- define "rill.eppName" -}}
{{ .Release.Name }}-epp
{{- end }}

{{- define "rill.eppSelectorLabels" -}}
app.kubernetes.io/name: rill
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end }}
