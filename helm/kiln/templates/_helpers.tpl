{{/* Names, labels, images and the shared pod pieces of the Kiln chart. */}}

{{- define "kiln.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kiln.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kiln.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kiln.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "api"). */}}
{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiln.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kiln.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kiln.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image of a component: (dict "root" $ "name" "api" "override" .Values.api.image). */}}
{{- define "kiln.image" -}}
{{- $root := .root -}}
{{- $tag := default (default $root.Chart.AppVersion $root.Values.image.tag) .override.tag -}}
{{- if .override.repository -}}
{{- printf "%s:%s" .override.repository $tag -}}
{{- else if $root.Values.image.registry -}}
{{- printf "%s/%s/%s:%s" $root.Values.image.registry $root.Values.image.prefix .name $tag -}}
{{- else -}}
{{- printf "%s/%s:%s" $root.Values.image.prefix .name $tag -}}
{{- end -}}
{{- end -}}

{{- define "kiln.secretName" -}}
{{- default (include "kiln.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "kiln.redisHost" -}}
{{- printf "%s-redis" (include "kiln.fullname" .) -}}
{{- end -}}

{{- define "kiln.postgresHost" -}}
{{- printf "%s-postgres" (include "kiln.fullname" .) -}}
{{- end -}}

{{- define "kiln.minioHost" -}}
{{- printf "%s-minio" (include "kiln.fullname" .) -}}
{{- end -}}

{{/* The S3 endpoint Kiln talks to: the explicit one, else the bundled MinIO, else AWS. */}}
{{- define "kiln.s3Endpoint" -}}
{{- if .Values.config.s3EndpointUrl -}}
{{- .Values.config.s3EndpointUrl -}}
{{- else if .Values.minio.bundled -}}
{{- printf "http://%s:9000" (include "kiln.minioHost" .) -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations that roll the pods when their configuration changes. */}}
{{- define "kiln.configChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/* Environment of every Kiln container: ConfigMap, then Secret. */}}
{{- define "kiln.envFrom" -}}
- configMapRef:
    name: {{ include "kiln.fullname" . }}
- secretRef:
    name: {{ include "kiln.secretName" . }}
{{- end -}}

{{- define "kiln.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.sizeLimit }}
- name: home
  emptyDir:
    sizeLimit: {{ .Values.scratch.sizeLimit }}
{{- end -}}

{{- define "kiln.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /var/lib/kiln
{{- end -}}
