# want: 15:16 Invalid relay owners
agent "alice" {
  command = ["/bin/true"]
}
agent "bob" {
  command = ["/bin/true"]
}
account "relay" {
  user   = "cage-relay"
  role   = "operator"
  agents = ["alice"]
}
relay {
  token_file = "/etc/nixcage/secrets/telegram"
  owners     = []
  account    = "relay"
  chat "alice" {
    chat_id = -100123
  }
}
