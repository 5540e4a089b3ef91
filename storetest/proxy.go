package storetest

import (
	"net"
	neturl "net/url"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/opbroker/opbroker/store"
)

// Proxy stands between a store and its PostgreSQL on a loopback port, so that a test
// can make the database unreachable the way a broken network does: Freeze stops every
// byte in both directions while the connections stay open, and new connections hang
// in the same way; Thaw lets them pass again, as a network that heals does.
type Proxy struct {
	lis    net.Listener
	target string
	done   chan struct{} // closed at cleanup

	mu      sync.Mutex
	flowing chan struct{} // closed while bytes pass; replaced by an open one at Freeze
	strand  chan struct{} // closed at Strand for the connections open then; replaced
	conns   []net.Conn
	wg      sync.WaitGroup
}

// NewStoreBehindProxy is NewStore whose store reaches the database through a Proxy.
// The administrator's pool goes direct.
func NewStoreBehindProxy(t testing.TB) (*store.Store, *pgxpool.Pool, *Proxy) {
	t.Helper()
	url := Schema(t)
	u, err := neturl.Parse(url)
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("storetest: %v", err)
	}
	flowing := make(chan struct{})
	close(flowing)
	p := &Proxy{lis: lis, target: u.Host, flowing: flowing, strand: make(chan struct{}), done: make(chan struct{})}
	p.wg.Add(1)
	go p.serve()
	u.Host = lis.Addr().String()
	st, admin := store.New(Pool(t, u.String())), Pool(t, AdminURL(t, url))
	// Cleanups run last first: the proxy closes its connections before the pools close
	// them, so that a pool does not wait out its close timeout on a frozen connection.
	t.Cleanup(p.close)
	return st, admin, p
}

// Freeze makes the database unreachable: nothing more passes, and nothing is closed.
// Freezing a frozen proxy does nothing.
func (p *Proxy) Freeze() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.flowing:
		p.flowing = make(chan struct{})
	default:
	}
}

// Strand stops every byte of the connections open now, for good, while new connections
// pass: as when a primary is stopped or cut off and another takes over, its clients'
// connections stay open and nothing answers on them.
func (p *Proxy) Strand() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.strand)
	p.strand = make(chan struct{})
}

// Thaw makes the database reachable again: what was held while frozen passes on, in
// order, and so does everything after it (a connection its client gave up on meanwhile
// ends when those bytes reach its closed end). Thawing a proxy that is not frozen does
// nothing.
func (p *Proxy) Thaw() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.flowing:
	default:
		close(p.flowing)
	}
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		client, err := p.lis.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			client.Close()
			continue
		}
		p.mu.Lock()
		select {
		case <-p.done:
			// The cleanup has begun and may have closed the connections already: close
			// these too, or the server would hold them open until it times them out.
			p.mu.Unlock()
			client.Close()
			server.Close()
			return
		default:
		}
		p.conns = append(p.conns, client, server)
		strand := p.strand
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(server, client, strand)
		go p.pipe(client, server, strand)
	}
}

// pipe copies from src to dst until either fails. While the proxy is frozen it holds
// what it read, keeping both connections open, until a thaw or the cleanup; once strand
// is closed it holds it until the cleanup.
func (p *Proxy) pipe(dst, src net.Conn, strand <-chan struct{}) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		flowing := p.flowing
		p.mu.Unlock()
		select {
		case <-strand:
			<-p.done
			return
		default:
		}
		select {
		case <-flowing:
		case <-p.done:
			return
		}
		if n > 0 {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			dst.Close()
			return
		}
	}
}

func (p *Proxy) close() {
	close(p.done)
	p.lis.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
