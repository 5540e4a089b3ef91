package simtarget

import (
	"net"
	"net/http"
	"time"

	"github.com/opbroker/opbroker/target"
)

// Server is a Target listening on a loopback port.
type Server struct {
	*Target
	// URL is the base URL of the target's API, e.g. http://127.0.0.1:41234.
	URL string
	srv *http.Server
}

// Start runs a target with cfg on 127.0.0.1 (a free port) until Close.
func Start(cfg Config) (*Server, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{Target: New(cfg), URL: "http://" + lis.Addr().String()}
	s.srv = &http.Server{Handler: s.Target, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = s.srv.Serve(lis) }()
	return s, nil
}

// Close releases held requests and stops the server.
func (s *Server) Close() {
	s.Target.Close()
	s.srv.Close()
}

// Targets returns the contracts of this server (Contracts at its URL, for its Config).
func (s *Server) Targets() (*target.Targets, error) {
	return target.New(Contracts(s.URL, s.cfg)...)
}
