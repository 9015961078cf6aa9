{{/* Labels of every object: the same as deploy/base's, plus Helm's own. */}}
{{- define "gpuslice.labels" -}}
app.kubernetes.io/part-of: gpuslice
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The gpuslice image: repository:tag, and @digest when one is pinned. */}}
{{- define "gpuslice.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (toString .Values.image.tag) -}}
{{- if .Values.image.digest }}{{ printf "%s@%s" $ref .Values.image.digest }}{{ else }}{{ $ref }}{{ end -}}
{{- end }}

{{/* Labels of the DRA driver's objects: deploy/dra's (its component) and Helm's. */}}
{{- define "gpuslice.draLabels" -}}
{{ include "gpuslice.labels" . }}
app.kubernetes.io/component: dra-driver
{{- end }}
