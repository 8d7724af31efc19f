# want: 12:7 Relay chats overlap
agent "alice" {
  command = ["/bin/true"]
}
agent "bob" {
  command = ["/bin/true"]
}
account "relay" {
  user = "cage-relay"
  role = "operator"
}
relay {
  token_file = "/etc/nixcage/secrets/telegram"
  owners     = [42]
  account    = "relay"
  chat "alice" {
    chat_id = -100123
  }
  chat "bob" {
    chat_id = -100123
    topic   = 7
  }
}
