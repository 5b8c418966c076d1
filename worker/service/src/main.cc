// kvpool-worker: see worker/service/README.md.
#include "kvpool/worker/service/worker_server.h"

int main(int argc, char** argv) { return kvpool::worker::WorkerMain(argc, argv); }
