// Package tgfake is a fake Telegram Bot API server for tests: real HTTP,
// speaking the protocol as core.telegram.org/bots/api documents it, with
// its own JSON types (not the client library's, so a misuse of the
// library shows): getMe, getUpdates long polling with offsets, sendMessage,
// sendChatAction, sendDocument (multipart upload), getFile and the file
// download path, and error answers (401 for a wrong token, any error code
// injected by the test, 429 with parameters.retry_after).
//
// A test adds updates (messages users "send") and files, and reads what
// the bot sent. Control is in-process (Server's methods) or, for a server
// running inside a test machine, over HTTP (Control).
package tgfake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// User is a Telegram user.
type User struct {
	ID        int64  `json:"id"`
	IsBot     bool   `json:"is_bot"`
	FirstName string `json:"first_name"`
	Username  string `json:"username,omitempty"`
}

// Chat is a Telegram chat.
type Chat struct {
	ID      int64  `json:"id"`
	Type    string `json:"type"` // private, group, supergroup
	Title   string `json:"title,omitempty"`
	IsForum bool   `json:"is_forum,omitempty"`
}

// Document is a file sent as a document.
type Document struct {
	FileID       string `json:"file_id"`
	FileUniqueID string `json:"file_unique_id"`
	FileName     string `json:"file_name,omitempty"`
	FileSize     int64  `json:"file_size,omitempty"`
}

// Message is a message (in an update, or what a send returns).
type Message struct {
	MessageID       int64     `json:"message_id"`
	MessageThreadID int64     `json:"message_thread_id,omitempty"`
	IsTopicMessage  bool      `json:"is_topic_message,omitempty"`
	From            *User     `json:"from,omitempty"`
	Chat            Chat      `json:"chat"`
	Date            int64     `json:"date"`
	Text            string    `json:"text,omitempty"`
	Caption         string    `json:"caption,omitempty"`
	Document        *Document `json:"document,omitempty"`
}

// Update is one getUpdates entry.
type Update struct {
	UpdateID int64    `json:"update_id"`
	Message  *Message `json:"message,omitempty"`
}

// Sent is one call the bot made that sends something.
type Sent struct {
	Seq      int       `json:"seq"`
	Method   string    `json:"method"` // sendMessage, sendChatAction, sendDocument
	ChatID   int64     `json:"chat_id"`
	ThreadID int64     `json:"message_thread_id,omitempty"`
	Text     string    `json:"text,omitempty"`
	Action   string    `json:"action,omitempty"`
	Caption  string    `json:"caption,omitempty"`
	FileName string    `json:"file_name,omitempty"`
	Data     []byte    `json:"data,omitempty"`
	At       time.Time `json:"at"`
	// Refused is the error code the server answered (0: accepted).
	Refused int `json:"refused,omitempty"`
}

// Fault is an error answer to inject.
type Fault struct {
	Method      string `json:"method"`
	Code        int    `json:"code"`
	Description string `json:"description"`
	RetryAfter  int    `json:"retry_after,omitempty"`
	Times       int    `json:"times"` // how many calls of Method get it
}

type file struct {
	data []byte
	path string
}

// Server is the fake. Create with New; serve with its Handler.
type Server struct {
	Token string
	Bot   User

	mu      sync.Mutex
	cond    chan struct{} // closed and renewed when updates or sends change
	updates []Update
	nextUpd int64
	nextMsg int64
	files   map[string]file
	sent    []Sent
	faults  []Fault
	// Polls counts getUpdates calls, Offsets the offsets they carried.
	Offsets []int64
}

// New makes a server for token.
func New(token string) *Server {
	return &Server{Token: token, Bot: User{ID: 777000111, IsBot: true, FirstName: "nixcage", Username: "nixcage_test_bot"},
		cond: make(chan struct{}), nextUpd: 1000, nextMsg: 1, files: map[string]file{}}
}

func (s *Server) changed() {
	close(s.cond)
	s.cond = make(chan struct{})
}

// AddMessage queues a message update and returns its update_id.
func (s *Server) AddMessage(m Message) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextUpd++
	m.MessageID = s.nextMsg
	s.nextMsg++
	if m.Date == 0 {
		m.Date = time.Now().Unix()
	}
	if m.MessageThreadID != 0 {
		m.IsTopicMessage = true
	}
	s.updates = append(s.updates, Update{UpdateID: s.nextUpd, Message: &m})
	s.changed()
	return s.nextUpd
}

// AddFile stores a file users "uploaded" and returns the Document for a
// message.
func (s *Server) AddFile(name string, data []byte) *Document {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := fmt.Sprintf("file-%d", len(s.files)+1)
	s.files[id] = file{data: data, path: "documents/" + id + "_" + name}
	return &Document{FileID: id, FileUniqueID: "u" + id, FileName: name, FileSize: int64(len(data))}
}

// Inject makes the next f.Times calls of f.Method fail with f.
func (s *Server) Inject(f Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = append(s.faults, f)
}

// Sent returns everything sent from seq on (seq starts at 0).
func (s *Server) Sent(from int) []Sent {
	s.mu.Lock()
	defer s.mu.Unlock()
	if from >= len(s.sent) {
		return nil
	}
	return append([]Sent(nil), s.sent[from:]...)
}

// Pending reports how many queued updates the bot has not confirmed.
func (s *Server) Pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.updates)
}

// WaitSent waits until a call from seq on satisfies ok and returns it.
func (s *Server) WaitSent(ctx context.Context, from int, ok func(Sent) bool) (Sent, error) {
	for {
		s.mu.Lock()
		for i := from; i < len(s.sent); i++ {
			if ok(s.sent[i]) {
				x := s.sent[i]
				s.mu.Unlock()
				return x, nil
			}
		}
		ch := s.cond
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return Sent{}, fmt.Errorf("nothing matching was sent: %w", ctx.Err())
		case <-ch:
		}
	}
}

type answer struct {
	OK          bool              `json:"ok"`
	Result      any               `json:"result,omitempty"`
	ErrorCode   int               `json:"error_code,omitempty"`
	Description string            `json:"description,omitempty"`
	Parameters  *answerParameters `json:"parameters,omitempty"`
}

type answerParameters struct {
	RetryAfter int `json:"retry_after,omitempty"`
}

func reply(w http.ResponseWriter, code int, a answer) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(a)
}

func fail(w http.ResponseWriter, code int, desc string) {
	reply(w, code, answer{ErrorCode: code, Description: desc})
}

// Handler serves the Bot API: /bot<token>/<method> and
// /file/bot<token>/<path>.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/", s.api)
	return mux
}

func (s *Server) api(w http.ResponseWriter, r *http.Request) {
	if rest, ok := strings.CutPrefix(r.URL.Path, "/file/bot"); ok {
		s.download(w, r, rest)
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/bot")
	if !ok {
		fail(w, http.StatusNotFound, "Not Found")
		return
	}
	token, method, ok := strings.Cut(rest, "/")
	if !ok || token != s.Token {
		fail(w, http.StatusUnauthorized, "Unauthorized")
		return
	}
	if err := parseForm(r); err != nil {
		fail(w, http.StatusBadRequest, "Bad Request: "+err.Error())
		return
	}
	if f, ok := s.fault(method); ok {
		a := answer{ErrorCode: f.Code, Description: f.Description}
		if f.RetryAfter > 0 {
			a.Parameters = &answerParameters{RetryAfter: f.RetryAfter}
		}
		s.record(method, r, f.Code)
		reply(w, f.Code, a)
		return
	}
	switch method {
	case "getMe":
		reply(w, 200, answer{OK: true, Result: s.Bot})
	case "getUpdates":
		s.getUpdates(w, r)
	case "sendMessage", "sendChatAction", "sendDocument":
		s.sendLike(w, r, method)
	case "getFile":
		s.getFile(w, r)
	default:
		fail(w, http.StatusNotFound, "Not Found: method not found")
	}
}

// parseForm accepts what the Bot API accepts: a query string,
// application/x-www-form-urlencoded, application/json or multipart/form-data.
func parseForm(r *http.Request) error {
	ct := r.Header.Get("Content-Type")
	switch {
	case strings.HasPrefix(ct, "multipart/form-data"):
		// A call without parameters may come as an empty multipart body
		// (no parts, not even the closing boundary); Telegram takes it.
		err := r.ParseMultipartForm(64 << 20)
		if errors.Is(err, io.EOF) {
			r.Form = map[string][]string{}
			return nil
		}
		return err
	case strings.HasPrefix(ct, "application/json"):
		var m map[string]any
		if err := json.NewDecoder(r.Body).Decode(&m); err != nil && err != io.EOF {
			return err
		}
		r.Form = map[string][]string{}
		for k, v := range m {
			switch x := v.(type) {
			case string:
				r.Form.Set(k, x)
			default:
				b, _ := json.Marshal(x)
				r.Form.Set(k, string(b))
			}
		}
		return nil
	}
	return r.ParseForm()
}

func (s *Server) fault(method string) (Fault, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.faults {
		f := &s.faults[i]
		if f.Method == method && f.Times > 0 {
			f.Times--
			return *f, true
		}
	}
	return Fault{}, false
}

func intParam(r *http.Request, name string) (int64, error) {
	v := r.FormValue(name)
	if v == "" {
		return 0, nil
	}
	return strconv.ParseInt(v, 10, 64)
}

func (s *Server) getUpdates(w http.ResponseWriter, r *http.Request) {
	offset, err1 := intParam(r, "offset")
	timeout, err2 := intParam(r, "timeout")
	if err1 != nil || err2 != nil {
		fail(w, http.StatusBadRequest, "Bad Request: offset and timeout are integers")
		return
	}
	deadline := time.Now().Add(time.Duration(timeout) * time.Second)
	s.mu.Lock()
	s.Offsets = append(s.Offsets, offset)
	s.mu.Unlock()
	for {
		s.mu.Lock()
		// An offset confirms every update below it: they are gone for good.
		kept := s.updates[:0]
		for _, u := range s.updates {
			if u.UpdateID >= offset {
				kept = append(kept, u)
			}
		}
		s.updates = kept
		if len(s.updates) > 0 || !time.Now().Before(deadline) {
			out := append([]Update{}, s.updates...)
			s.mu.Unlock()
			reply(w, 200, answer{OK: true, Result: out})
			return
		}
		ch := s.cond
		s.mu.Unlock()
		select {
		case <-ch:
		case <-time.After(time.Until(deadline)):
		case <-r.Context().Done():
			return
		}
	}
}

func (s *Server) record(method string, r *http.Request, refused int) Sent {
	chat, _ := intParam(r, "chat_id")
	thread, _ := intParam(r, "message_thread_id")
	x := Sent{Method: method, ChatID: chat, ThreadID: thread, Text: r.FormValue("text"), Action: r.FormValue("action"),
		Caption: r.FormValue("caption"), At: time.Now(), Refused: refused}
	if r.MultipartForm != nil {
		if fhs := r.MultipartForm.File["document"]; len(fhs) > 0 {
			if f, err := fhs[0].Open(); err == nil {
				x.Data, _ = io.ReadAll(f)
				f.Close()
			}
			x.FileName = fhs[0].Filename
		}
	}
	s.mu.Lock()
	x.Seq = len(s.sent)
	s.sent = append(s.sent, x)
	s.changed()
	s.mu.Unlock()
	return x
}

func (s *Server) sendLike(w http.ResponseWriter, r *http.Request, method string) {
	chat, err := intParam(r, "chat_id")
	if err != nil || chat == 0 {
		fail(w, http.StatusBadRequest, "Bad Request: chat not found")
		return
	}
	switch method {
	case "sendMessage":
		if t := r.FormValue("text"); t == "" {
			fail(w, http.StatusBadRequest, "Bad Request: message text is empty")
			return
		} else if n := len(utf16Units(t)); n > 4096 {
			fail(w, http.StatusBadRequest, "Bad Request: message is too long")
			return
		}
	case "sendChatAction":
		if r.FormValue("action") == "" {
			fail(w, http.StatusBadRequest, "Bad Request: wrong parameter action in request")
			return
		}
	case "sendDocument":
		if r.MultipartForm == nil || len(r.MultipartForm.File["document"]) == 0 {
			fail(w, http.StatusBadRequest, "Bad Request: there is no document in the request")
			return
		}
	}
	x := s.record(method, r, 0)
	if method == "sendChatAction" {
		reply(w, 200, answer{OK: true, Result: true})
		return
	}
	s.mu.Lock()
	id := s.nextMsg
	s.nextMsg++
	s.mu.Unlock()
	m := Message{MessageID: id, MessageThreadID: x.ThreadID, From: &s.Bot, Chat: Chat{ID: chat, Type: "supergroup"}, Date: time.Now().Unix(), Text: x.Text, Caption: x.Caption}
	if method == "sendDocument" {
		m.Document = &Document{FileID: fmt.Sprintf("sent-%d", id), FileUniqueID: fmt.Sprintf("usent-%d", id), FileName: x.FileName, FileSize: int64(len(x.Data))}
	}
	reply(w, 200, answer{OK: true, Result: m})
}

type fileResult struct {
	FileID       string `json:"file_id"`
	FileUniqueID string `json:"file_unique_id"`
	FileSize     int64  `json:"file_size"`
	FilePath     string `json:"file_path"`
}

func (s *Server) getFile(w http.ResponseWriter, r *http.Request) {
	id := r.FormValue("file_id")
	s.mu.Lock()
	f, ok := s.files[id]
	s.mu.Unlock()
	if !ok {
		fail(w, http.StatusBadRequest, "Bad Request: invalid file_id")
		return
	}
	reply(w, 200, answer{OK: true, Result: fileResult{FileID: id, FileUniqueID: "u" + id, FileSize: int64(len(f.data)), FilePath: f.path}})
}

func (s *Server) download(w http.ResponseWriter, r *http.Request, rest string) {
	token, path, ok := strings.Cut(rest, "/")
	if !ok || token != s.Token {
		http.Error(w, "Unauthorized", http.StatusUnauthorized)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range s.files {
		if f.path == path {
			w.Header().Set("Content-Length", strconv.Itoa(len(f.data)))
			w.Write(f.data)
			return
		}
	}
	http.Error(w, "Not Found", http.StatusNotFound)
}

func utf16Units(s string) []uint16 {
	var out []uint16
	for _, r := range s {
		if r >= 0x10000 {
			out = append(out, 0, 0)
		} else {
			out = append(out, 0)
		}
	}
	return out
}
