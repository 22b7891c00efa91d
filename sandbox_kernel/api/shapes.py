"""CreateOS's sandbox shapes as this project knows them (its API docs): the local engine
serves exactly these, and the command line and sealed notebooks check a shape against them
before a local sandbox is asked for (CreateOS may know more)."""

from sandbox_kernel.api.models import Shape

DEFAULT_DISK_MIB = 10240
SHAPES = [Shape(id=f"s-{cpu}vcpu-{label}", vcpu=cpu, mem_mib=mib, default_disk_mib=DEFAULT_DISK_MIB)
          for cpu, mib, label in ((1, 256, "256mb"), (1, 512, "512mb"), (1, 1024, "1gb"),
                                  (1, 2048, "2gb"), (2, 2048, "2gb"), (2, 4096, "4gb"),
                                  (4, 4096, "4gb"))]
