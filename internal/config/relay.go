package config

import (
	"fmt"
	"net"
	"net/url"
	"sort"

	"github.com/hashicorp/hcl/v2"

	"github.com/nixcage/nixcage/internal/paths"
)

// Relay is the chat relay: a daemon of its own (cage-relay) that holds the
// bot token and nothing else, and acts on caged only as Account.
type Relay struct {
	// TokenFile is the host path of the bot token, loaded with
	// LoadCredential=; the relay never sees the path, only the credential.
	TokenFile string
	// Owners are the Telegram user ids whose commands the relay carries
	// out; everyone else is refused and audited.
	Owners []int64
	// Account names the declared account the relay calls caged as; its
	// role and agent list bound what any chat command can do.
	Account string
	// APIURL is the Bot API server (DefaultRelayAPIURL; a self-hosted
	// telegram-bot-api server, or a test's fake one on loopback).
	APIURL string
	// MaxFileBytes bounds a file in either direction (/get, an upload, a
	// release).
	MaxFileBytes int64
	Chats        []RelayChat // sorted by agent
}

// RelayChat is where one agent answers: a chat, and in a forum group
// optionally one topic (message_thread_id); Topic 0 is the whole chat.
type RelayChat struct {
	Agent  string `json:"agent"`
	ChatID int64  `json:"chat_id"`
	Topic  int64  `json:"topic,omitempty"`
}

// Relay defaults.
const (
	DefaultRelayAPIURL = "https://api.telegram.org"
	// DefaultRelayMaxFileBytes is the Bot API's own download limit (20 MB
	// through getFile on api.telegram.org).
	DefaultRelayMaxFileBytes = 20 << 20
	// MaxRelayFileBytes is caged's own ceiling for a workspace file
	// (bus.MaxFileBytes, 50 MiB, Telegram's limit for files bots send; a
	// test in internal/relay keeps the two equal).
	MaxRelayFileBytes = 50 << 20
)

// RelayDoc is the relay's runtime document (paths.RelayConfig): the
// validated relay block and nothing else of the configuration, so the relay
// learns no more about the agents than the names of those it serves.
type RelayDoc struct {
	Schema       int         `json:"schema"`
	Owners       []int64     `json:"owners"`
	APIURL       string      `json:"api_url"`
	MaxFileBytes int64       `json:"max_file_bytes"`
	Chats        []RelayChat `json:"chats"`
}

// RelayDocSchema is RelayDoc's version.
const RelayDocSchema = 1

// Doc is r's runtime document.
func (r *Relay) Doc() RelayDoc {
	return RelayDoc{Schema: RelayDocSchema, Owners: r.Owners, APIURL: r.APIURL, MaxFileBytes: r.MaxFileBytes, Chats: r.Chats}
}

// Check re-checks a runtime document as the relay reads it (it may be
// written by hand on a host without cagectl render): the same rules as the
// relay block, minus those that need the rest of the configuration.
func (d *RelayDoc) Check() error {
	if d.Schema != RelayDocSchema {
		return fmt.Errorf("relay document schema %d; this cage-relay reads schema %d (re-render with this version's cagectl)", d.Schema, RelayDocSchema)
	}
	if err := checkOwners(d.Owners); err != nil {
		return err
	}
	if err := checkAPIURL(d.APIURL); err != nil {
		return err
	}
	if d.MaxFileBytes <= 0 || d.MaxFileBytes > MaxRelayFileBytes {
		return fmt.Errorf("max_file_bytes = %d; give 1 to %d", d.MaxFileBytes, MaxRelayFileBytes)
	}
	if len(d.Chats) == 0 {
		return fmt.Errorf("no chats: the relay would answer nowhere; add a chat block per agent")
	}
	seen := map[string]bool{}
	for _, c := range d.Chats {
		if !agentNameRE.MatchString(c.Agent) {
			return fmt.Errorf("chat of %q: not an agent name", c.Agent)
		}
		if seen[c.Agent] {
			return fmt.Errorf("agent %s has two chats", c.Agent)
		}
		seen[c.Agent] = true
		if err := checkChat(c); err != nil {
			return err
		}
	}
	return chatClash(d.Chats)
}

func (v *validator) relay(r *relayV1, cfg *Config) *Relay {
	out := &Relay{TokenFile: r.TokenFile, Owners: r.Owners, Account: r.Account, APIURL: DefaultRelayAPIURL, MaxFileBytes: DefaultRelayMaxFileBytes}
	v.checkAbsPath(at(r.Body, "token_file"), "relay token_file", r.TokenFile)
	if err := checkOwners(r.Owners); err != nil {
		v.errorf(at(r.Body, "owners"), "Invalid relay owners", "relay: %v.", err)
	}
	if r.APIURL != nil {
		out.APIURL = *r.APIURL
		if err := checkAPIURL(*r.APIURL); err != nil {
			v.errorf(at(r.Body, "api_url"), "Invalid Bot API address", "relay: %v.", err)
		}
	}
	if r.MaxFileBytes != nil {
		out.MaxFileBytes = *r.MaxFileBytes
		if *r.MaxFileBytes <= 0 || *r.MaxFileBytes > MaxRelayFileBytes {
			v.errorf(at(r.Body, "max_file_bytes"), "Invalid relay file limit", "relay: max_file_bytes = %d; give 1 to %d bytes (caged moves workspace files up to 50 MiB; the Bot API serves downloads up to 20 MB, a self-hosted Bot API server more), or leave it out for %d.", *r.MaxFileBytes, MaxRelayFileBytes, DefaultRelayMaxFileBytes)
		}
	}
	acct := v.relayAccount(r, cfg)
	if len(r.Chats) == 0 {
		v.errorf(block(r.Body), "Relay without chats", "relay: no chat block, so the relay would answer nowhere. Add chat \"AGENT\" { chat_id = ... } for each agent it serves.")
	}
	seen := map[string]hcl.Range{}
	for i := range r.Chats {
		c := &r.Chats[i]
		rc := RelayChat{Agent: c.Agent, ChatID: c.ChatID}
		if c.Topic != nil {
			rc.Topic = *c.Topic
		}
		rng := block(c.Body)
		if prev, dup := seen[c.Agent]; dup {
			v.errorf(rng, "Duplicate relay chat", "relay: agent %q already has a chat at %s; an agent answers in one chat (or one topic).", c.Agent, prev)
			continue
		}
		seen[c.Agent] = rng
		if cfg.Agent(c.Agent) == nil {
			v.errorf(rng, "Unknown agent", "relay: chat %q names no declared agent. Declare the agent or remove the chat block.", c.Agent)
			continue
		}
		if acct != nil && !acct.Covers(c.Agent) {
			v.errorf(rng, "Agent outside the relay's account", "relay: chat %q, but account %q does not cover agent %q, so caged would refuse every command from that chat. Add %q to the account's agents, or remove the chat block.", c.Agent, acct.Name, c.Agent, c.Agent)
		}
		if err := checkChat(rc); err != nil {
			v.errorf(rng, "Invalid relay chat", "relay: %v.", err)
			continue
		}
		out.Chats = append(out.Chats, rc)
	}
	sort.Slice(out.Chats, func(i, j int) bool { return out.Chats[i].Agent < out.Chats[j].Agent })
	if err := chatClash(out.Chats); err != nil {
		v.errorf(block(r.Body), "Relay chats overlap", "relay: %v.", err)
	}
	return out
}

// relayAccount finds the account the relay acts as. It must be a user
// account for paths.RelayUser: a group account would also grant whoever
// else is in the group, and any other user is not what the relay's unit
// runs as.
func (v *validator) relayAccount(r *relayV1, cfg *Config) *Account {
	rng := at(r.Body, "account")
	for _, a := range cfg.Accounts {
		if a.Name != r.Account {
			continue
		}
		if a.User != paths.RelayUser {
			v.errorf(rng, "Relay account for another user", "relay: account %q is for %s, but the relay runs as user %q. Declare account %q { user = %q, role = \"operator\", agents = [...] } for it.", a.Name, a.whom(), paths.RelayUser, r.Account, paths.RelayUser)
			return nil
		}
		return a
	}
	v.errorf(rng, "Unknown relay account", "relay: account = %q, which is not declared. Declare account %q { user = %q, role = \"operator\", agents = [...] }: its role and agents bound what the relay may do.", r.Account, r.Account, paths.RelayUser)
	return nil
}

func (a *Account) whom() string {
	if a.User != "" {
		return "user " + a.User
	}
	return "group " + a.Group
}

func checkOwners(owners []int64) error {
	if len(owners) == 0 {
		return fmt.Errorf("owners is empty, so nobody could command the relay; list the Telegram user ids of the operators (a bot such as @userinfobot shows yours)")
	}
	seen := map[int64]bool{}
	for _, o := range owners {
		if o <= 0 {
			return fmt.Errorf("owner %d is not a Telegram user id (user ids are positive; negative ids are chats)", o)
		}
		if seen[o] {
			return fmt.Errorf("owner %d is listed twice", o)
		}
		seen[o] = true
	}
	return nil
}

// checkAPIURL allows https anywhere and plain http only to loopback (a
// self-hosted Bot API server on the host, or a test's fake one): the token
// is part of every request path.
func checkAPIURL(s string) error {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" || (u.Path != "" && u.Path != "/") {
		return fmt.Errorf("api_url = %q; write the server's base address such as %q", s, DefaultRelayAPIURL)
	}
	switch u.Scheme {
	case "https":
		return nil
	case "http":
		host := u.Hostname()
		if ip := net.ParseIP(host); (ip != nil && ip.IsLoopback()) || host == "localhost" {
			return nil
		}
		return fmt.Errorf("api_url = %q: plain http carries the bot token in the clear; use https, or http only to a loopback address", s)
	}
	return fmt.Errorf("api_url = %q: use https (or http to loopback)", s)
}

func checkChat(c RelayChat) error {
	if c.ChatID == 0 {
		return fmt.Errorf("chat %q: chat_id = 0; give the group's id (negative, such as -1001234567890)", c.Agent)
	}
	if c.Topic < 0 {
		return fmt.Errorf("chat %q: topic = %d; a forum topic id (message_thread_id) is positive", c.Agent, c.Topic)
	}
	return nil
}

// chatClash refuses two agents in one place: the same chat and topic, or
// a whole chat (topic 0) that also has an agent on one of its topics.
func chatClash(chats []RelayChat) error {
	for i, a := range chats {
		for _, b := range chats[i+1:] {
			if a.ChatID != b.ChatID {
				continue
			}
			if a.Topic == b.Topic || a.Topic == 0 || b.Topic == 0 {
				return fmt.Errorf("agents %s and %s both answer in chat %d (topics %d and %d); give each its own chat, or each its own topic of a forum group", a.Agent, b.Agent, a.ChatID, a.Topic, b.Topic)
			}
		}
	}
	return nil
}

func canonRelay(r *Relay) map[string]any {
	chats := map[string]any{}
	for _, c := range r.Chats {
		m := map[string]any{"chat_id": c.ChatID}
		if c.Topic != 0 {
			m["topic"] = c.Topic
		}
		chats[c.Agent] = m
	}
	return map[string]any{
		"token_file": r.TokenFile, "owners": r.Owners, "account": r.Account,
		"api_url": r.APIURL, "max_file_bytes": r.MaxFileBytes, "chat": chats,
	}
}
