package flightdeck.spark;

import com.google.protobuf.CodedInputStream;
import com.google.protobuf.CodedOutputStream;
import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.channels.Channels;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.SortedMap;
import org.apache.arrow.vector.ipc.ReadChannel;
import org.apache.arrow.vector.ipc.message.MessageSerializer;
import org.apache.arrow.vector.types.pojo.Schema;

/**
 * The few messages of {@code protos/flightdeck.proto} the connector sends
 * and reads, in protobuf's wire format (protobuf-java's coded streams).
 * Field numbers are the .proto's; the server reading them in the PySpark
 * tests is their check.
 */
final class Wire {
  private Wire() {}

  /** One message being written. */
  private static final class Out {
    private final ByteArrayOutputStream bytes = new ByteArrayOutputStream();
    private final CodedOutputStream out = CodedOutputStream.newInstance(bytes);

    private interface Write {
      void run() throws IOException;
    }

    private Out io(Write w) {
      try {
        w.run();
      } catch (IOException e) {
        throw new UncheckedIOException(e);
      }
      return this;
    }

    Out string(int field, String v) {
      return io(() -> {
        if (!v.isEmpty()) {
          out.writeString(field, v);
        }
      });
    }

    Out repeatedString(int field, List<String> vs) {
      return io(() -> {
        for (String v : vs) {
          out.writeString(field, v);
        }
      });
    }

    Out uint32(int field, long v) {
      return io(() -> {
        if (v != 0) {
          out.writeUInt32(field, (int) v);
        }
      });
    }

    Out uint64(int field, long v) {
      return io(() -> {
        if (v != 0) {
          out.writeUInt64(field, v);
        }
      });
    }

    /** A proto3 {@code optional} field: written even when 0. */
    Out optionalUint64(int field, long v) {
      return io(() -> out.writeUInt64(field, v));
    }

    Out bool(int field, boolean v) {
      return io(() -> {
        if (v) {
          out.writeBool(field, true);
        }
      });
    }

    Out message(int field, byte[] v) {
      return io(() -> out.writeByteArray(field, v));
    }

    byte[] bytes() {
      io(out::flush);
      return bytes.toByteArray();
    }
  }

  /**
   * {@code PutPartition}: the descriptor command of a {@code DoPut}; with
   * {@code replace}, the attempt is staged beside the dataset for write
   * {@code writeId} to replace it when sealed.
   */
  static byte[] putPartition(
      String dataset, int partition, int attempt, String writeId, boolean replace) {
    return new Out()
        .string(1, dataset)
        .uint32(2, partition)
        .uint32(3, attempt)
        .bool(4, true) // explicit commit: PutCommit{rows} on the last message
        .string(7, writeId)
        .bool(8, replace)
        .bytes();
  }

  /**
   * {@code DropDataset}, naming the failed write {@code abortWrite} (may be
   * empty): the server refuses that write's attempts from then on. With
   * {@code staged}, only what that write staged to replace the dataset goes;
   * a dataset write {@code keepWrite} (may be empty) swapped in stays.
   */
  static byte[] drop(String dataset, String abortWrite, boolean staged, String keepWrite) {
    return new Out()
        .string(1, dataset)
        .string(3, abortWrite)
        .bool(4, staged)
        .string(5, keepWrite)
        .bytes();
  }

  /** {@code PutCommit{rows}}: the writer's marker on the last message. */
  static byte[] putCommit(long rows) {
    return new Out().optionalUint64(1, rows).bytes();
  }

  private static byte[] partitionAttempt(int partition, int attempt) {
    return new Out().uint32(1, partition).uint32(2, attempt).bytes();
  }

  /**
   * {@code SealDataset}: the winning attempt of every partition, on one
   * server ({@code members} of one location: named in {@code attempts}) or
   * on several (a cluster seal, {@code members} by location); with
   * {@code replaceWrite} (may be empty), what that write staged takes the
   * dataset's place.
   */
  static byte[] seal(
      String dataset,
      int partitions,
      SortedMap<String, SortedMap<Integer, Integer>> members,
      String replaceWrite) {
    Out seal = new Out().string(1, dataset).uint32(2, partitions).string(5, replaceWrite);
    if (members.size() == 1) {
      for (Map.Entry<Integer, Integer> w : members.values().iterator().next().entrySet()) {
        seal.message(3, partitionAttempt(w.getKey(), w.getValue()));
      }
      return seal.bytes();
    }
    for (Map.Entry<String, SortedMap<Integer, Integer>> m : members.entrySet()) {
      Out member = new Out().string(1, m.getKey());
      for (Map.Entry<Integer, Integer> w : m.getValue().entrySet()) {
        member.message(2, partitionAttempt(w.getKey(), w.getValue()));
      }
      seal.message(4, member.bytes());
    }
    return seal.bytes();
  }

  /** {@code DescribeDataset}: a dataset's name. */
  static byte[] datasetName(String dataset) {
    return new Out().string(1, dataset).bytes();
  }

  /**
   * {@code ReadPlan} for one rank reading unshuffled {@code rows} rows from
   * {@code startSample} (0: to the end), projected to {@code columns} (none:
   * all) or read as the SQL expressions {@code select} (none: the columns),
   * over the rows {@code filter} selects (empty: every row), of the
   * dataset as sealed when {@code sealedAs} was described (0: as it is now),
   * served by member {@code holder} of a dataset sealed across servers
   * ("": the plan's default).
   */
  static byte[] readFrom(
      String dataset,
      long startSample,
      long rows,
      int batchRows,
      List<String> columns,
      List<String> select,
      String filter,
      long sealedAs,
      String holder) {
    Out plan = new Out()
        .string(1, dataset)
        .uint32(2, 1)
        .uint32(6, batchRows)
        .repeatedString(8, columns)
        .uint64(9, startSample)
        .string(17, filter)
        .repeatedString(18, select)
        .uint64(19, sealedAs)
        .uint64(20, rows);
    if (!holder.isEmpty()) {
      plan.uint32(14, 1).repeatedString(15, List.of(holder));
    }
    return plan.bytes();
  }

  /** {@code PutAck}: what the server stored of an attempt. */
  record PutAck(int partition, int attempt, long rows, long bytes, String location) {}

  static PutAck putAck(byte[] body) {
    String location = "";
    int partition = 0;
    int attempt = 0;
    long rows = 0;
    long bytes = 0;
    try {
      CodedInputStream in = CodedInputStream.newInstance(body);
      for (int tag = in.readTag(); tag != 0; tag = in.readTag()) {
        switch (tag >>> 3) {
          case 2 -> partition = in.readUInt32();
          case 3 -> attempt = in.readUInt32();
          case 4 -> rows = in.readUInt64();
          case 5 -> bytes = in.readUInt64();
          case 6 -> location = in.readString();
          default -> in.skipField(tag);
        }
      }
    } catch (IOException e) {
      throw new IllegalStateException("the server's PutAck does not decode: " + e.getMessage(), e);
    }
    return new PutAck(partition, attempt, rows, bytes, location);
  }

  /**
   * A partition of a described dataset: its winning attempt's rows, and the
   * member holding it on a dataset sealed across servers ("" otherwise).
   */
  record Partition(int partition, int attempt, long rows, String holder) {}

  /**
   * {@code DatasetInfo}, the parts the connector reads; {@code partitions}
   * are every member's on a dataset sealed across servers (from its
   * layout), this server's otherwise; {@code sealedAs} identifies this seal
   * of it (the layout id on a cluster, else the generation), for read plans
   * that must not mix two writes; {@code schema} is its Arrow schema as an
   * IPC schema message (empty before the first commit).
   */
  record DatasetInfo(
      int state,
      long rows,
      List<Partition> partitions,
      long sealedAs,
      double writtenSecondsAgo,
      byte[] schema) {
    static final int SEALED = 2;
    static final int SEALING = 3;

    /** The dataset's Arrow schema, decoded from {@code schema}. */
    Schema arrowSchema() {
      if (schema.length == 0) {
        return new Schema(List.of());
      }
      try {
        return MessageSerializer.deserializeSchema(
            new ReadChannel(Channels.newChannel(new ByteArrayInputStream(schema))));
      } catch (IOException e) {
        throw new IllegalStateException(
            "the server's DatasetInfo.schema does not decode: " + e.getMessage(), e);
      }
    }

    boolean sealed() {
      return state == SEALED;
    }

    /** This server's part is sealed; the seal across servers did not finish here. */
    boolean sealing() {
      return state == SEALING;
    }
  }

  static DatasetInfo datasetInfo(byte[] body) {
    int state = 0;
    long rows = 0;
    long generation = 0;
    long layout = 0;
    double writtenSecondsAgo = 0;
    byte[] schema = new byte[0];
    List<Partition> partitions = new ArrayList<>();
    List<Partition> everyMember = new ArrayList<>();
    try {
      CodedInputStream in = CodedInputStream.newInstance(body);
      for (int tag = in.readTag(); tag != 0; tag = in.readTag()) {
        switch (tag >>> 3) {
          case 2 -> state = in.readEnum();
          case 3 -> rows = in.readUInt64();
          case 6 -> schema = in.readByteArray();
          case 7 -> partitions.add(partition(in.readByteArray()));
          case 8 -> generation = in.readUInt64();
          case 12 -> layout = layoutPartitions(in.readByteArray(), everyMember);
          case 13 -> writtenSecondsAgo = in.readDouble();
          default -> in.skipField(tag);
        }
      }
    } catch (IOException e) {
      throw new IllegalStateException(
          "the server's DatasetInfo does not decode: " + e.getMessage(), e);
    }
    return new DatasetInfo(state, rows, everyMember.isEmpty() ? partitions : everyMember,
        layout != 0 ? layout : generation, writtenSecondsAgo, schema);
  }

  /** The partitions of every member of a {@code ClusterLayout}; returns its id. */
  private static long layoutPartitions(byte[] layout, List<Partition> out) throws IOException {
    long id = 0;
    CodedInputStream in = CodedInputStream.newInstance(layout);
    for (int tag = in.readTag(); tag != 0; tag = in.readTag()) {
      if (tag >>> 3 == 1) {
        id = in.readUInt64();
        continue;
      }
      if (tag >>> 3 != 2) {
        in.skipField(tag);
        continue;
      }
      CodedInputStream member = CodedInputStream.newInstance(in.readByteArray());
      String location = "";
      List<Partition> held = new ArrayList<>();
      for (int t = member.readTag(); t != 0; t = member.readTag()) {
        switch (t >>> 3) {
          case 1 -> location = member.readString();
          case 3 -> held.add(partition(member.readByteArray()));
          default -> member.skipField(t);
        }
      }
      for (Partition p : held) {
        out.add(new Partition(p.partition(), p.attempt(), p.rows(), location));
      }
    }
    return id;
  }

  /**
   * {@code PlanInfo.partition_rows}, from a read plan's {@code FlightInfo}
   * app metadata: the rows of the plan's row space in each stored
   * partition, in partition order (empty where the server sends none).
   */
  static long[] planPartitionRows(byte[] body) {
    List<Long> rows = new ArrayList<>();
    try {
      CodedInputStream in = CodedInputStream.newInstance(body == null ? new byte[0] : body);
      for (int tag = in.readTag(); tag != 0; tag = in.readTag()) {
        if (tag >>> 3 != 1) {
          in.skipField(tag);
        } else if ((tag & 7) == 2) { // packed
          int limit = in.pushLimit(in.readRawVarint32());
          while (in.getBytesUntilLimit() > 0) {
            rows.add(in.readUInt64());
          }
          in.popLimit(limit);
        } else {
          rows.add(in.readUInt64());
        }
      }
    } catch (IOException e) {
      throw new IllegalStateException(
          "the server's PlanInfo does not decode: " + e.getMessage(), e);
    }
    return rows.stream().mapToLong(Long::longValue).toArray();
  }

  private static Partition partition(byte[] body) throws IOException {
    int partition = 0;
    int attempt = 0;
    long rows = 0;
    CodedInputStream in = CodedInputStream.newInstance(body);
    for (int tag = in.readTag(); tag != 0; tag = in.readTag()) {
      switch (tag >>> 3) {
        case 1 -> partition = in.readUInt32();
        case 2 -> attempt = in.readUInt32();
        case 3 -> rows = in.readUInt64();
        default -> in.skipField(tag);
      }
    }
    return new Partition(partition, attempt, rows, "");
  }
}
