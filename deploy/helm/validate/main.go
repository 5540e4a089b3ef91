// Command validate checks manifests rendered by `helm template` without a cluster:
// each document is decoded strictly into the Kubernetes API's Go types (an unknown or
// repeated field, a wrong type or an unknown kind fails), and the objects are checked
// against each other the way the chart means them to fit: names and labels are valid,
// selectors select the broker's pods, named ports and volumes exist.
//
//	helm template ... | go run .
//	go run . FILE...    # each FILE one rendering of the chart, checked on its own
//
// It is a module of its own so that the broker's go.mod gains no Kubernetes
// dependency; its go.mod also pins the helm the checks run (`go tool helm`).
package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// object is what every kind the chart renders is: metadata, and its kind.
type object interface {
	metav1.Object
	runtime.Object
}

// kinds are the objects the chart may render, by apiVersion and kind.
var kinds = map[string]func() object{
	"v1/ConfigMap":                  func() object { return new(corev1.ConfigMap) },
	"v1/Secret":                     func() object { return new(corev1.Secret) },
	"v1/Service":                    func() object { return new(corev1.Service) },
	"apps/v1/Deployment":            func() object { return new(appsv1.Deployment) },
	"batch/v1/Job":                  func() object { return new(batchv1.Job) },
	"policy/v1/PodDisruptionBudget": func() object { return new(policyv1.PodDisruptionBudget) },
	"monitoring.coreos.com/v1/ServiceMonitor": func() object { return new(monitoringv1.ServiceMonitor) },
}

func main() {
	files := os.Args[1:]
	if len(files) == 0 {
		files = []string{"-"}
	}
	failed := false
	for _, name := range files {
		objects, problems := decodeFile(name)
		switch {
		case len(problems) > 0:
			// An object that failed to decode is missing from the checks: they would only
			// report what it lacks.
		case len(objects) == 0:
			problems = []string{"no manifests"}
		default:
			problems = check(objects)
		}
		for _, p := range problems {
			fmt.Fprintf(os.Stderr, "validate: %s: %s\n", name, p)
		}
		if len(problems) > 0 {
			failed = true
			continue
		}
		fmt.Printf("%s: %d manifests valid\n", name, len(objects))
	}
	if failed {
		os.Exit(1)
	}
}

// decodeFile decodes every document of a file (- for the standard input).
func decodeFile(name string) (objects []object, problems []string) {
	var r io.Reader = os.Stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return nil, []string{err.Error()}
		}
		defer f.Close()
		r = f
	}
	docs := utilyaml.NewYAMLReader(bufio.NewReader(r))
	for i := 1; ; i++ {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			return objects, problems
		}
		if err != nil {
			return objects, append(problems, err.Error())
		}
		obj, err := decode(doc)
		if err != nil {
			problems = append(problems, fmt.Sprintf("document %d%s: %v", i, source(doc), err))
		} else if obj != nil {
			objects = append(objects, obj)
		}
	}
}

// source is the template a document came from, as helm template marks it.
func source(doc []byte) string {
	for line := range strings.Lines(string(doc)) {
		if s, ok := strings.CutPrefix(line, "# Source: "); ok {
			return " (" + strings.TrimSpace(s) + ")"
		}
	}
	return ""
}

// decode decodes one document strictly into its type; nil for an empty document.
func decode(doc []byte) (object, error) {
	var meta metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &meta); err != nil {
		return nil, err
	}
	if meta.APIVersion == "" && meta.Kind == "" {
		var rest map[string]any
		if err := yaml.Unmarshal(doc, &rest); err != nil || len(rest) > 0 {
			return nil, errors.New("no apiVersion and kind")
		}
		return nil, nil // only comments
	}
	newObject, ok := kinds[meta.APIVersion+"/"+meta.Kind]
	if !ok {
		return nil, fmt.Errorf("%s %s is not a kind this chart renders", meta.APIVersion, meta.Kind)
	}
	obj := newObject()
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return nil, err
	}
	return obj, nil
}

// check checks each object, then how they fit together.
func check(objects []object) []string {
	var problems []string
	report := func(what, format string, args ...any) {
		problems = append(problems, what+": "+fmt.Sprintf(format, args...))
	}
	var deployments []*appsv1.Deployment
	var services []*corev1.Service
	seen := map[string]bool{}
	for _, obj := range objects {
		what := describe(obj)
		if seen[what] {
			report(what, "rendered twice")
		}
		seen[what] = true
		checkMeta(obj, report, what)
		switch o := obj.(type) {
		case *appsv1.Deployment:
			deployments = append(deployments, o)
			selector, err := metav1.LabelSelectorAsSelector(o.Spec.Selector)
			if err != nil || selector.Empty() {
				report(what, "selector %v: %v", o.Spec.Selector, err)
			} else if !selector.Matches(labels.Set(o.Spec.Template.Labels)) {
				report(what, "the selector does not select the pod template's labels")
			}
			checkPod(&o.Spec.Template.Spec, report, what)
		case *batchv1.Job:
			if p := o.Spec.Template.Spec.RestartPolicy; p != corev1.RestartPolicyNever && p != corev1.RestartPolicyOnFailure {
				report(what, "restartPolicy %q: a Job's is Never or OnFailure", p)
			}
			checkPod(&o.Spec.Template.Spec, report, what)
		case *corev1.Service:
			services = append(services, o)
			for _, msg := range validation.IsDNS1035Label(o.Name) {
				report(what, "name: %s", msg)
			}
			if len(o.Spec.Ports) == 0 {
				report(what, "no ports")
			}
		case *corev1.ConfigMap:
			for key := range o.Data {
				for _, msg := range validation.IsConfigMapKey(key) {
					report(what, "key %q: %s", key, msg)
				}
			}
		case *corev1.Secret:
			for key := range o.StringData {
				for _, msg := range validation.IsConfigMapKey(key) {
					report(what, "key %q: %s", key, msg)
				}
			}
		case *policyv1.PodDisruptionBudget:
			if (o.Spec.MinAvailable == nil) == (o.Spec.MaxUnavailable == nil) {
				report(what, "give one of minAvailable and maxUnavailable")
			}
		}
	}

	// Every selector of a Service and a PodDisruptionBudget selects a Deployment's pods,
	// and a Service's named target ports are ports of those pods' containers.
	podsOf := func(selector labels.Selector) *appsv1.Deployment {
		for _, d := range deployments {
			if !selector.Empty() && selector.Matches(labels.Set(d.Spec.Template.Labels)) {
				return d
			}
		}
		return nil
	}
	for _, obj := range objects {
		what := describe(obj)
		switch o := obj.(type) {
		case *corev1.Service:
			d := podsOf(labels.SelectorFromSet(o.Spec.Selector))
			if d == nil {
				report(what, "its selector selects no Deployment's pods")
				continue
			}
			for _, p := range o.Spec.Ports {
				if p.TargetPort.Type == intstr.String && !hasPort(d.Spec.Template.Spec.Containers, p.TargetPort.StrVal) {
					report(what, "targetPort %q is no container port of %s", p.TargetPort.StrVal, d.Name)
				}
			}
		case *policyv1.PodDisruptionBudget:
			selector, err := metav1.LabelSelectorAsSelector(o.Spec.Selector)
			if err != nil || podsOf(selector) == nil {
				report(what, "its selector selects no Deployment's pods")
			}
		case *monitoringv1.ServiceMonitor:
			selector, err := metav1.LabelSelectorAsSelector(&o.Spec.Selector)
			var matched []*corev1.Service
			for _, s := range services {
				if err == nil && !selector.Empty() && selector.Matches(labels.Set(s.Labels)) {
					matched = append(matched, s)
				}
			}
			if len(matched) != 1 {
				report(what, "its selector selects %d Services, not one", len(matched))
				continue
			}
			for _, e := range o.Spec.Endpoints {
				if !hasServicePort(matched[0], e.Port) {
					report(what, "endpoint port %q is no port of Service %s", e.Port, matched[0].Name)
				}
			}
		}
	}
	return problems
}

// describe names an object for the report: its kind and name.
func describe(obj object) string {
	return obj.GetObjectKind().GroupVersionKind().Kind + " " + obj.GetName()
}

func checkMeta(meta metav1.Object, report func(what, format string, args ...any), what string) {
	for _, msg := range validation.IsDNS1123Subdomain(meta.GetName()) {
		report(what, "name: %s", msg)
	}
	checkLabels(meta.GetLabels(), report, what)
	for key := range meta.GetAnnotations() {
		for _, msg := range validation.IsQualifiedName(key) {
			report(what, "annotation %q: %s", key, msg)
		}
	}
}

func checkLabels(set map[string]string, report func(what, format string, args ...any), what string) {
	for key, value := range set {
		for _, msg := range validation.IsQualifiedName(key) {
			report(what, "label %q: %s", key, msg)
		}
		for _, msg := range validation.IsValidLabelValue(value) {
			report(what, "label %q value %q: %s", key, value, msg)
		}
	}
}

// checkPod checks what the API server would refuse or the kubelet fail on: names,
// ports, probes that name ports, mounts of volumes that do not exist, repeated
// variables.
func checkPod(pod *corev1.PodSpec, report func(what, format string, args ...any), what string) {
	volumes := map[string]bool{}
	for _, v := range pod.Volumes {
		if volumes[v.Name] {
			report(what, "volume %q twice", v.Name)
		}
		volumes[v.Name] = true
		for _, msg := range validation.IsDNS1123Label(v.Name) {
			report(what, "volume %q: %s", v.Name, msg)
		}
	}
	mounted := map[string]bool{}
	if len(pod.Containers) == 0 {
		report(what, "no containers")
	}
	for _, c := range pod.Containers {
		in := fmt.Sprintf("%s, container %q", what, c.Name)
		if c.Name == "" || c.Image == "" {
			report(in, "a container needs a name and an image")
		}
		ports := map[string]bool{}
		for _, p := range c.Ports {
			if p.ContainerPort < 1 || p.ContainerPort > 65535 {
				report(in, "port %d", p.ContainerPort)
			}
			if p.Name != "" {
				for _, msg := range validation.IsValidPortName(p.Name) {
					report(in, "port name %q: %s", p.Name, msg)
				}
				ports[p.Name] = true
			}
		}
		for probeName, probe := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
			if probe == nil {
				continue
			}
			var port *intstr.IntOrString
			handlers := 0
			if h := probe.HTTPGet; h != nil {
				port, handlers = &h.Port, handlers+1
			}
			if h := probe.TCPSocket; h != nil {
				port, handlers = &h.Port, handlers+1
			}
			if h := probe.GRPC; h != nil {
				handlers++
				if !hasPortNumber(c, h.Port) {
					report(in, "the %s probe's gRPC port %d is no container port", probeName, h.Port)
				}
			}
			if probe.Exec != nil {
				handlers++
			}
			if handlers != 1 {
				report(in, "the %s probe has %d handlers, not one", probeName, handlers)
			}
			if port != nil && port.Type == intstr.String && !ports[port.StrVal] {
				report(in, "the %s probe's port %q is no container port", probeName, port.StrVal)
			}
		}
		env := map[string]bool{}
		for _, e := range c.Env {
			if env[e.Name] {
				report(in, "variable %s twice", e.Name)
			}
			env[e.Name] = true
			for _, msg := range validation.IsEnvVarName(e.Name) {
				report(in, "variable %q: %s", e.Name, msg)
			}
		}
		for _, m := range c.VolumeMounts {
			if !volumes[m.Name] {
				report(in, "mounts volume %q, which the pod does not have", m.Name)
			}
			if !strings.HasPrefix(m.MountPath, "/") || mounted[m.MountPath] {
				report(in, "mount path %q: not absolute, or mounted twice", m.MountPath)
			}
			mounted[m.MountPath] = true
		}
	}
	var unused []string
	for _, v := range pod.Volumes {
		if !isMounted(pod, v.Name) {
			unused = append(unused, v.Name)
		}
	}
	if len(unused) > 0 {
		report(what, "volumes mounted by no container: %s", strings.Join(unused, ", "))
	}
}

func isMounted(pod *corev1.PodSpec, volume string) bool {
	for _, c := range pod.Containers {
		for _, m := range c.VolumeMounts {
			if m.Name == volume {
				return true
			}
		}
	}
	return false
}

func hasPort(containers []corev1.Container, name string) bool {
	for _, c := range containers {
		for _, p := range c.Ports {
			if p.Name == name {
				return true
			}
		}
	}
	return false
}

func hasPortNumber(c corev1.Container, number int32) bool {
	for _, p := range c.Ports {
		if p.ContainerPort == number {
			return true
		}
	}
	return false
}

func hasServicePort(s *corev1.Service, name string) bool {
	for _, p := range s.Spec.Ports {
		if p.Name == name {
			return true
		}
	}
	return false
}
