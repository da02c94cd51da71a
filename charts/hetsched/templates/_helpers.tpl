{{- /* HETSCHED_DATABASE_URL: from the Secret databaseUrl.existingSecret names, else the plain value. */ -}}
{{- define "hetsched.databaseUrl" -}}
- name: HETSCHED_DATABASE_URL
{{- if .Values.databaseUrl.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.databaseUrl.existingSecret }}
      key: {{ .Values.databaseUrl.secretKey }}
{{- else }}
  value: {{ .Values.databaseUrl.value | quote }}
{{- end }}
{{- end }}
{{- /* The Endpoint Picker's namespace: its InferencePool's (epp.namespace), else the release's. */ -}}
{{- define "hetsched.eppNamespace" -}}
{{ .Values.epp.namespace | default .Release.Namespace }}
{{- end }}
